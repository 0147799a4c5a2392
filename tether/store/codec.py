"""Opt-in payload encryption (AES-256-GCM with key ids) and the codec server for the Web UI.

Turn it on by pointing ``TETHER_ENCRYPTION_KEY_FILE`` at a key file; the worker, ``starter.py``
and the codec server then encrypt every payload they send to Temporal (workflow inputs and
results, activity inputs and results, signals, queries, memos, Web UI summaries) and every
failure message and stack trace. Temporal stores ciphertext only. Search attributes are never
encrypted: keep them free of secrets and personal data (Tether writes only the run state and
the tenant id there).

Key file: one key per line, ``KEY_ID:BASE64_OF_32_RANDOM_BYTES``; ``#`` starts a comment. The
FIRST key encrypts; every key listed decrypts. To rotate, put a new key on top and keep the old
ones below for as long as histories encrypted with them exist (retention + any archive)::

    python -m tether.store.codec genkey --id 2025-06 > new.keys && cat old.keys >> new.keys

Each encrypted payload carries its key id in its metadata (``encryption-key-id``); the key id
is also authenticated data, so a payload cannot be decrypted with a key it was not made with.

The codec server lets people who are allowed to see the data read it in the Web UI (or with
``temporal ... --codec-endpoint``)::

    python -m tether.store.codec --port 8081 --key-file tether.keys \\
        --origin http://localhost:8233 [--token-file token.txt]

``POST /encode`` and ``POST /decode`` take and return ``{"payloads": [...]}`` (Temporal's JSON
form). Browsers may call it only from the listed origins (CORS); with a token configured, every
call needs ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hmac
import json
import os
import re
import secrets
import signal
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, DefaultFailureConverterWithEncodedAttributes, PayloadCodec

KEY_FILE_ENV = "TETHER_ENCRYPTION_KEY_FILE"
ENCODING = b"binary/encrypted"
KEY_ID_METADATA = "encryption-key-id"
NONCE_BYTES = 12
KEY_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DEFAULT_ORIGINS = ("http://localhost:8233", "http://127.0.0.1:8233")


class KeyFileError(ValueError):
    """The key file is missing, empty or malformed."""


def _aesgcm(key: bytes) -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:  # pragma: no cover - depends on the install
        raise SystemExit(
            "payload encryption needs the `cryptography` package: pip install 'tether[crypto]'"
        ) from None
    return AESGCM(key)


@dataclass(frozen=True)
class Keyring:
    """Key id -> key, in file order. The first key encrypts; all of them decrypt."""

    keys: Mapping[str, bytes]

    @property
    def active(self) -> str:
        return next(iter(self.keys))

    @classmethod
    def parse(cls, text: str, *, source: str = "key file") -> Keyring:
        keys: dict[str, bytes] = {}
        for n, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            key_id, sep, encoded = line.partition(":")
            key_id, encoded = key_id.strip(), encoded.strip()
            if not sep or not KEY_ID_PATTERN.match(key_id):
                raise KeyFileError(
                    f"{source} line {n}: expected KEY_ID:BASE64KEY (key id of letters, digits, "
                    f"'.', '_' or '-'); create one with `python -m tether.store.codec genkey`"
                )
            try:
                key = base64.b64decode(encoded, validate=True)
            except ValueError:
                raise KeyFileError(f"{source} line {n}: key {key_id!r} is not base64") from None
            if len(key) != 32:
                raise KeyFileError(
                    f"{source} line {n}: key {key_id!r} has {len(key)} bytes, AES-256 needs 32"
                )
            if key_id in keys:
                raise KeyFileError(f"{source} line {n}: key id {key_id!r} appears twice")
            keys[key_id] = key
        if not keys:
            raise KeyFileError(f"{source} holds no key")
        return cls(keys)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Keyring:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise KeyFileError(f"cannot read key file {os.fspath(path)}: {e.strerror}") from None
        return cls.parse(text, source=f"key file {os.fspath(path)}")


def new_key_line(key_id: str) -> str:
    if not KEY_ID_PATTERN.match(key_id):
        raise KeyFileError(f"invalid key id {key_id!r}")
    return f"{key_id}:{base64.b64encode(secrets.token_bytes(32)).decode()}"


class EncryptionCodec(PayloadCodec):
    """AES-256-GCM over the whole serialized payload (data and metadata)."""

    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring
        self._ciphers = {key_id: _aesgcm(key) for key_id, key in keyring.keys.items()}

    # Sync halves: the codec server calls these from plain threads.
    def encrypt(self, payload: Payload) -> Payload:
        key_id = self.keyring.active
        nonce = secrets.token_bytes(NONCE_BYTES)
        sealed = self._ciphers[key_id].encrypt(nonce, payload.SerializeToString(), key_id.encode())
        return Payload(
            metadata={"encoding": ENCODING, KEY_ID_METADATA: key_id.encode()},
            data=nonce + sealed,
        )

    def decrypt(self, payload: Payload) -> Payload:
        if payload.metadata.get("encoding") != ENCODING:
            return payload  # written before encryption was turned on
        key_id = payload.metadata.get(KEY_ID_METADATA, b"").decode()
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise ValueError(
                f"payload was encrypted with key {key_id!r}, which is not in the key file: "
                f"keep retired keys below the active one while their histories exist"
            )
        data = payload.data
        plain = cipher.decrypt(data[:NONCE_BYTES], data[NONCE_BYTES:], key_id.encode())
        return Payload.FromString(plain)

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.encrypt(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.decrypt(p) for p in payloads]


def data_converter(codec: PayloadCodec | None = None) -> DataConverter:
    """The pydantic data converter, with ``codec`` on payloads and on failure messages."""
    if codec is None:
        return pydantic_data_converter
    return dataclasses.replace(
        pydantic_data_converter,
        payload_codec=codec,
        # Moves failure messages and stack traces into a payload, so the codec encrypts them.
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )


def codec_from_env(env: Mapping[str, str] = os.environ) -> EncryptionCodec | None:
    path = env.get(KEY_FILE_ENV, "").strip()
    return EncryptionCodec(Keyring.load(path)) if path else None


def data_converter_from_env(env: Mapping[str, str] = os.environ) -> DataConverter:
    """Encrypting when ``TETHER_ENCRYPTION_KEY_FILE`` is set, plain pydantic otherwise."""
    return data_converter(codec_from_env(env))


# ----------------------------------------------------------------------------- codec server


@dataclass(frozen=True)
class CodecServerConfig:
    codec: EncryptionCodec
    origins: frozenset[str]
    token: str | None = None


class CodecServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], config: CodecServerConfig) -> None:
        self.config = config
        super().__init__(address, CodecHandler)


class CodecHandler(BaseHTTPRequestHandler):
    server: CodecServer
    server_version = "TetherCodec/1"

    def _cors(self) -> dict[str, str]:
        origin = self.headers.get("Origin")
        if origin is None or origin not in self.server.config.origins:
            return {}
        return {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Methods": "POST, OPTIONS",
            "Access-Control-Allow-Headers": "Content-Type, X-Namespace, Authorization",
            "Access-Control-Allow-Credentials": "true",
            "Access-Control-Max-Age": "600",
            "Vary": "Origin",
        }

    def _reply(self, status: int, body: dict[str, Any] | None = None) -> None:
        payload = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        for name, value in self._cors().items():
            self.send_header(name, value)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _origin_refused(self) -> bool:
        # Browsers always send Origin on cross-origin calls; the CLI and curl send none.
        origin = self.headers.get("Origin")
        if origin is not None and origin not in self.server.config.origins:
            self._reply(403, {"error": f"origin {origin} is not allowed"})
            return True
        return False

    def do_OPTIONS(self) -> None:  # CORS preflight: carries no credentials by design
        if self._origin_refused():
            return
        self._reply(204)

    def do_GET(self) -> None:
        if self.path.rstrip("/") in ("/health", "/healthz"):
            self._reply(200, {"status": "ok"})
        else:
            self._reply(404, {"error": "not found"})

    def do_POST(self) -> None:
        if self._origin_refused():
            return
        token = self.server.config.token
        if token is not None:
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                self._reply(401, {"error": "missing or wrong bearer token"})
                return
        path = self.path.split("?", 1)[0].rstrip("/")
        action = path.rsplit("/", 1)[-1]
        if action not in ("encode", "decode"):
            self._reply(404, {"error": "POST /encode or /decode"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            payloads = json_format.Parse(self.rfile.read(length) or b"{}", Payloads())
        except (ValueError, json_format.ParseError) as e:
            self._reply(400, {"error": f"expected {{\"payloads\": [...]}}: {e}"})
            return
        codec = self.server.config.codec
        fn = codec.encrypt if action == "encode" else codec.decrypt
        try:
            out = Payloads(payloads=[fn(p) for p in payloads.payloads])
        except Exception as e:  # wrong key, tampered data: say so, never crash the server
            self._reply(422, {"error": f"cannot {action}: {type(e).__name__}: {e}"})
            return
        self._reply(200, json_format.MessageToDict(out))

    def log_message(self, format: str, *args: Any) -> None:
        # One line per request, without payloads or headers.
        sys.stderr.write(f"codec: {self.command} {self.path} {format % args}\n")


def make_codec_server(
    port: int,
    keyring: Keyring,
    *,
    host: str = "127.0.0.1",
    origins: Iterable[str] = DEFAULT_ORIGINS,
    token: str | None = None,
) -> CodecServer:
    config = CodecServerConfig(
        codec=EncryptionCodec(keyring),
        origins=frozenset(o.rstrip("/") for o in origins if o),
        token=token or None,
    )
    return CodecServer((host, port), config)


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _genkey(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tether.store.codec genkey")
    parser.add_argument("--id", default=None, help="key id (default: k-<random>)")
    parser.add_argument(
        "--if-missing", metavar="PATH",
        help="write a new key file to PATH (mode 600) unless one exists; print nothing",
    )
    args = parser.parse_args(argv)
    line = new_key_line(args.id or f"k-{secrets.token_hex(4)}")
    if args.if_missing:
        path = Path(args.if_missing)
        if path.exists():
            Keyring.load(path)  # fail loudly on a broken file
            return 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(line + "\n")
        return 0
    print(line)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["genkey"]:
        return _genkey(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m tether.store.codec",
        description="Codec server: /encode and /decode for the Temporal Web UI and CLI. "
        "`python -m tether.store.codec genkey` prints a new key line.",
    )
    parser.add_argument("--host", default=os.environ.get("TETHER_CODEC_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("TETHER_CODEC_PORT", "8081")))
    parser.add_argument("--key-file", default=os.environ.get(KEY_FILE_ENV), help=f"env {KEY_FILE_ENV}")
    parser.add_argument(
        "--origin", action="append", default=None,
        help="Web UI origin allowed by CORS, repeatable (env TETHER_CODEC_ORIGINS, comma-separated; "
        f"default {', '.join(DEFAULT_ORIGINS)})",
    )
    parser.add_argument(
        "--token-file", default=os.environ.get("TETHER_CODEC_TOKEN_FILE"),
        help="require `Authorization: Bearer <token>` with the token in this file "
        "(env TETHER_CODEC_TOKEN_FILE)",
    )
    args = parser.parse_args(argv)
    if not args.key_file:
        parser.error(f"--key-file (or {KEY_FILE_ENV}) is required")
    try:
        keyring = Keyring.load(args.key_file)
    except KeyFileError as e:
        parser.error(str(e))
    origins = args.origin or _split(os.environ.get("TETHER_CODEC_ORIGINS")) or list(DEFAULT_ORIGINS)
    token = None
    if args.token_file:
        token = Path(args.token_file).read_text().strip() or None
        if token is None:
            parser.error(f"token file {args.token_file} is empty")
    server = make_codec_server(args.port, keyring, host=args.host, origins=origins, token=token)

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    bound, port = server.server_address[:2]
    host = bound.decode() if isinstance(bound, bytes) else bound
    print(
        f"codec server listening on http://{host}:{port} (keys {', '.join(keyring.keys)}; "
        f"active {keyring.active}; origins {', '.join(sorted(server.config.origins))}; "
        f"token {'required' if token else 'off'})",
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
