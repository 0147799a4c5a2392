"""Who is asking: a JWT from the organisation's sign-in layer, verified, or nobody.

Production: every request carries a JWT (``Authorization: Bearer``, or an identity-aware
proxy's assertion header such as ``X-Forwarded-Assertion``), verified by PyJWT against a JWKS
(a file, or a URL read through ``PyJWKClient``): signature by a key of the set, ``alg`` one of
the asymmetric algorithms below and the key's own (never ``none``, never HMAC), ``iss``,
``aud``, ``exp`` required, ``nbf`` honoured.

One person per sign-in: a token's stable claim (``iss`` and ``sub``) is mapped to the policy's
person where the inbox's subjects file names it (``[people.NAME] oidc_subject = "SUB"``,
``load_subjects``); a person bound so is nobody else's sign-in, whatever its name claim says.
Otherwise the configured claim names the person as the policy file does, exactly: a value that
differs from its normal form ("Bob", fullwidth "ＢＯＢ") is refused, never folded onto someone.

Local: ``--dev-login`` makes a key of its own at start and mints tokens for the people the
policy lists, kept in an HttpOnly, SameSite=Strict cookie; the same verifier checks them.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from workflows.identity import normalize_name

# Asymmetric only: a shared-secret (HS*) token could be minted by anyone holding the JWKS.
ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]
LEEWAY_SECONDS = 30
MAX_TOKEN_CHARS = 16_384
DEV_ISSUER = "tether-inbox-dev-login"
DEV_AUDIENCE = "tether-inbox"
DEV_SESSION_SECONDS = 8 * 3600
SESSION_COOKIE = "tether_inbox_session"


class Unauthenticated(Exception):
    """No verified identity. The message says what kind of failure, never the token."""


@dataclass(frozen=True)
class Person:
    name: str  # normalised, as the policy file and the runtime compare names
    source: str  # "bearer", "header" or "cookie": how it came (ambient ones need CSRF tokens)

    @property
    def ambient(self) -> bool:
        """Sent by the browser on its own (cookie, proxy header): a forged cross-site post would
        carry it too, so posts with it need the CSRF token."""
        return self.source != "bearer"


def load_subjects(path: Path) -> dict[str, str]:
    """The inbox's subjects file (TOML): ``[people.NAME] oidc_subject = "SUB"`` (or a list of
    them), each ``sub`` of the configured issuer bound to one person; returns sub -> person.
    ValueError naming what is wrong: a name not in its normal form, a subject given twice."""
    import tomllib

    try:
        document = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--subjects {path}: not a readable TOML file ({e})") from None
    people = document.get("people")
    if not isinstance(people, dict) or set(document) - {"people"}:
        raise ValueError(f"--subjects {path}: expected only [people.NAME] tables with oidc_subject")
    subjects: dict[str, str] = {}
    for name, entry in people.items():
        if _normal(name) != name:
            raise ValueError(f"--subjects {path}: person {name!r} is not written in its normal form {_normal(name)!r}")
        given = entry.get("oidc_subject") if isinstance(entry, dict) else None
        listed = [given] if isinstance(given, str) else given
        if not isinstance(listed, list) or not listed or not all(isinstance(s, str) and s for s in listed) or set(entry) != {"oidc_subject"}:
            raise ValueError(f"--subjects {path}: people.{name}: expected oidc_subject = \"SUB\" (or a list of them)")
        for sub in listed:
            if subjects.setdefault(sub, name) != name:
                raise ValueError(f"--subjects {path}: subject {sub!r} is bound to both {subjects[sub]!r} and {name!r}")
    return subjects


def _normal(raw: str) -> str | None:
    try:
        return normalize_name(raw)
    except ValueError:
        return None


class Verifier:
    """Verifies tokens against one JWKS, for one issuer and audience. ``subjects``: the inbox's
    subjects file (``load_subjects``: sub -> person)."""

    def __init__(
        self, *, jwks: str | dict[str, Any], issuer: str, audience: str, claim: str, subjects: dict[str, str] | None = None
    ) -> None:
        self.issuer, self.audience, self.claim = issuer, audience, claim
        self.subjects = dict(subjects or {})
        self.bound = set(self.subjects.values())  # people who sign in only with their own subject
        self._client: jwt.PyJWKClient | None = None
        self._set: jwt.PyJWKSet | None = None
        if isinstance(jwks, dict):
            self._set = jwt.PyJWKSet.from_dict(jwks)
        elif jwks.startswith(("https://", "http://")):
            self._client = jwt.PyJWKClient(jwks, cache_keys=True, lifespan=300, timeout=5)
        else:
            try:
                self._set = jwt.PyJWKSet.from_dict(json.loads(Path(jwks).read_text()))
            except (OSError, ValueError, jwt.PyJWKSetError) as e:
                raise ValueError(f"--jwks {jwks}: not a readable JWKS file ({e})") from None

    def _key(self, token: str, header: dict[str, Any]) -> jwt.PyJWK:
        if self._client is not None:
            return self._client.get_signing_key_from_jwt(token)
        assert self._set is not None
        kid = header.get("kid")
        keys = [k for k in self._set.keys if kid is None or k.key_id == kid]
        if len(keys) != 1:
            raise Unauthenticated("no key of the JWKS matches the token's kid")
        return keys[0]

    async def averify(self, token: str) -> str:
        """``verify``, off the event loop when the JWKS is fetched over HTTP (PyJWKClient blocks)."""
        if self._client is not None:
            return await asyncio.to_thread(self.verify, token)
        return self.verify(token)

    def verify(self, token: str) -> str:
        """The person the token names (normalised), or Unauthenticated."""
        if not token or len(token) > MAX_TOKEN_CHARS:
            raise Unauthenticated("no token, or an oversized one")
        try:
            header = jwt.get_unverified_header(token)
            alg = header.get("alg")
            if alg not in ALGORITHMS:
                raise Unauthenticated(f"algorithm {str(alg)[:16]!r} is not accepted")
            key = self._key(token, header)
            declared = key._jwk_data.get("alg")  # a key that names its algorithm signs only with it
            if declared is not None and declared != alg:
                raise Unauthenticated("the token's algorithm is not its key's")
            # (A key of another type than the algorithm's is refused by PyJWT itself.)
            claims = jwt.decode(
                token,
                key.key,
                algorithms=[alg],
                audience=self.audience,
                issuer=self.issuer,
                leeway=LEEWAY_SECONDS,
                options={"require": ["exp", "iss", "aud"], "verify_signature": True},
            )
        except Unauthenticated:
            raise
        except Exception as e:  # noqa: BLE001  (PyJWT's errors, and a key of another type than the token's
            # algorithm makes cryptography raise TypeError: every malformed token is a 401, never a 500)
            raise Unauthenticated(type(e).__name__) from None
        # The issuer is this verifier's one (checked above): its ``sub`` is the stable claim.
        sub = claims.get("sub")
        if isinstance(sub, str) and sub in self.subjects:
            return self.subjects[sub]
        raw = claims.get(self.claim)
        if not isinstance(raw, str):
            raise Unauthenticated(f"the token has no {self.claim!r} claim")
        name = _normal(raw)
        if name is None:
            raise Unauthenticated(f"the {self.claim!r} claim is not a usable name")
        if name != raw:
            # Never folded: "Bob", "ＢＯＢ" and "bob" may be three accounts of the sign-in layer.
            raise Unauthenticated(f"the {self.claim!r} claim is not written as the policy names people "
                                  "(a different case or width): refused, never folded onto someone")
        if name in self.bound:
            raise Unauthenticated(f"{name} signs in only with the subject the inbox's subjects file binds to them")
        return name


class DevLogin:
    """``--dev-login``: tokens this process mints for the policy's people, with its own key."""

    def __init__(self) -> None:
        self._key = Ed25519PrivateKey.generate()
        jwk = json.loads(jwt.algorithms.OKPAlgorithm.to_jwk(self._key.public_key()))
        self.verifier = Verifier(
            jwks={"keys": [{**jwk, "kid": "dev-login", "alg": "EdDSA", "use": "sig"}]},
            issuer=DEV_ISSUER,
            audience=DEV_AUDIENCE,
            claim="preferred_username",
        )

        # Sessions signed out before they expire (their jti): a copied cookie dies with logout.
        self._revoked: dict[str, float] = {}

    def mint(self, name: str) -> str:
        now = int(time.time())
        claims = {"iss": DEV_ISSUER, "aud": DEV_AUDIENCE, "preferred_username": name,
                  "iat": now, "nbf": now, "exp": now + DEV_SESSION_SECONDS, "jti": secrets.token_hex(16)}
        return jwt.encode(claims, self._key, algorithm="EdDSA", headers={"kid": "dev-login"})

    def verify(self, token: str) -> str:
        """The session's person, or Unauthenticated (also for a session signed out)."""
        name = self.verifier.verify(token)
        if self._jti(token) in self._revoked:
            raise Unauthenticated("this session was signed out")
        return name

    def revoke(self, token: str) -> None:
        """Sign the session out: its token is refused from now on, until it would expire anyway."""
        try:
            self.verifier.verify(token)
        except Unauthenticated:
            return  # not a session of ours: nothing to revoke
        now = time.time()
        self._revoked = {j: t for j, t in self._revoked.items() if t > now}
        self._revoked[self._jti(token)] = now + DEV_SESSION_SECONDS + LEEWAY_SECONDS

    @staticmethod
    def _jti(token: str) -> str:
        # Read after the signature was verified: the token is ours.
        return str(jwt.decode(token, options={"verify_signature": False}).get("jti", ""))
