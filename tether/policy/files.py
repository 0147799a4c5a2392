"""The policy file: reading it (TOML, with the Cedar files and key files it names), checking it
whole, and keeping it in force.

The file is TOML (``TETHER_POLICY`` or ``worker.py --policy PATH``; example:
``examples/billing/policy.toml``). It is read here, never in workflow code; its shapes are
``workflows/policy_file.py`` and the decisions over it the pure functions in
``workflows/policy.py``. ``PolicyStore`` re-reads the file when it changes, so revoking an
approver takes effect for runs already under way (approvals are re-checked before writes run);
a change that does not load leaves the last good policy in force. The activities that apply it
are ``activities/policy_checks.py``.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import tomllib
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from temporalio import activity

from tether.policy import cedar
from workflows import policy
from workflows.budgets import clip
from workflows.contract import SIGNER_NAME, STRICT
from workflows.identity import skeleton
from workflows.policy_file import Approver, PolicyDocument, Signer, TenantPolicy

RELOAD_FAILURES = "tether_policy_reload_failures"
log = logging.getLogger("tether.policy")

DEFAULT_SOURCE = "built-in default (no policy file): every write needs one approval from someone other than the requester"


class PolicyFileError(ValueError):
    """An invalid policy file, with the line and key that are wrong."""


_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-\"'.]+)\s*=")


def _locate(text: str, loc: tuple[str | int, ...]) -> int | None:
    """The line (1-based) where the key at ``loc`` is written, best effort."""
    wanted = [str(p) for p in loc if not isinstance(p, int)]
    best, best_len = None, 0
    table: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if m := _HEADER.match(line):
            table = [p.strip().strip('"') for p in m.group(1).split(".")]
            path = table
        elif m := _KEY.match(line):
            path = table + [p.strip().strip('"') for p in m.group(1).split(".")]
        else:
            continue
        common = 0
        for a, b in zip(path, wanted):
            if a != b:
                break
            common += 1
        if common > best_len or (common == best_len and common == len(path) and best is None):
            best, best_len = number, common
    return best


def parse_policy(text: str, source: str = "policy") -> PolicyDocument:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PolicyFileError(f"{source}: not valid TOML: {e}") from None
    try:
        return PolicyDocument.model_validate(raw, context=STRICT)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(err["loc"])
        if (unknown := re.search(r"unknown field\(s\): ([^,\s]+)", err["msg"])) is not None:
            loc += (unknown.group(1),)  # point at the unknown key itself
        key = ".".join(str(p) for p in loc)
        line = _locate(text, loc)
        where = f"line {line}, " if line else ""
        raise PolicyFileError(f"{source}: {where}key {key}: {err['msg']}") from None


# A policy file's problem as verdicts carry it to the runs: at most this many characters.
PROBLEM_CHARS = 600


@dataclass
class PolicyStore:
    """The policy file, re-read when its modification time changes. A change that does not load
    (invalid TOML or Cedar, past the size bounds) leaves the last good policy in force: it is
    logged and counted once per version of the file, and ``problem`` says so (the verdicts carry
    it to the run, ``tether status`` and the inbox show it) until a good version replaces it."""

    path: Path | None
    _cache: tuple[tuple[Any, ...], PolicyDocument, str] | None = field(default=None, repr=False)
    _cedar: dict[str, str] = field(default_factory=dict, repr=False)  # tenant -> its own Cedar text
    # The last change that did not load: (its version, why). None: the file in force is the file.
    _bad: tuple[tuple[Any, ...], str] | None = field(default=None, repr=False)
    # Key files the file names that were not there (keygen still to run): looked for at each load.
    _missing_keys: tuple[Path, ...] = field(default=(), repr=False)
    reload_failures: int = 0

    @property
    def problem(self) -> str | None:
        """Why the file on disk is not the policy in force (the last good one is), or None. Bounded:
        every verdict carries it into the run's state, its views and its details (a file's
        problems can run to many lines; `tether policy validate` lists them all)."""
        if self._bad is None or self._cache is None:
            return None
        kept = f" (kept the last good policy, hash {self._cache[2][:12]})"
        return clip(" ".join(self._bad[1].split()), PROBLEM_CHARS - len(kept)) + kept

    @classmethod
    def from_env(cls, path: str | None = None) -> PolicyStore:
        chosen = path or os.environ.get("TETHER_POLICY") or None
        store = cls(Path(chosen) if chosen else None)
        store.load()  # fail at worker start on a bad file, naming the line and the key
        return store

    def load(self) -> tuple[PolicyDocument | None, str]:
        """The document (None: no file, the built-in default applies) and its content hash (the
        TOML's, and the Cedar files' its tenants name)."""
        if self.path is None:
            return None, hashlib.sha256(DEFAULT_SOURCE.encode()).hexdigest()
        try:
            stat = self.path.stat()
            version: tuple[Any, ...] = (stat.st_mtime_ns, stat.st_size, stat.st_ino, *self._cedar_versions(),
                                        *(p.exists() for p in self._missing_keys))
        except FileNotFoundError:
            stat, version = None, ("missing",)
        if self._cache is None or self._cache[0] != version:
            if self._cache is not None and self._bad is not None and self._bad[0] == version:
                return self._cache[1], self._cache[2]  # that change did not load: said once already
            try:
                if stat is None:
                    raise PolicyFileError(f"policy file not found: {self.path}")
                self._read(stat)
            except (PolicyFileError, OSError, UnicodeDecodeError) as e:
                if self._cache is None:
                    if isinstance(e, PolicyFileError):
                        raise  # nothing good to keep: a worker does not start on it
                    raise PolicyFileError(f"{self.path}: cannot be read: {e}") from None
                self._bad = (version, str(e))
                self.reload_failures += 1
                try:
                    activity.metric_meter().create_counter(
                        RELOAD_FAILURES, "Policy file changes that did not load (the last good policy stays)", "1"
                    ).add(1)
                except RuntimeError:  # outside an activity (the inbox counts it on its health page)
                    pass
                log.error("policy file %s changed and does not load: %s; the last good policy (hash %s) stays in "
                          "force until the file is fixed", self.path, e, self._cache[2][:12])
                return self._cache[1], self._cache[2]
            self._bad = None
        cached = self._cache
        assert cached is not None, "_read stores what it read, or raises"
        return cached[1], cached[2]

    def _read(self, stat: os.stat_result) -> None:
        assert self.path is not None
        text = self.path.read_text()
        document = parse_policy(text, str(self.path))
        resolve_key_files(document, self.path, strict=False)
        cedar_texts = load_cedar_files(document, self.path)
        digest = hashlib.sha256(text.encode())
        for name in sorted(cedar_texts):
            digest.update(cedar_texts[name].encode())
        self._cedar = cedar_texts
        # A key file that is not there yet (keygen still to run): its appearing is a new version.
        holders: list[Signer | Approver] = [
            *document.signers.values(),
            *(a for tenant in document.tenants.values() for a in (tenant.approvers or {}).values()),
        ]
        self._missing_keys = tuple(
            (self.path.parent / holder.public_key_file).resolve()
            for holder in holders if holder.public_key_file is not None and holder.public_key is None
        )
        version = (stat.st_mtime_ns, stat.st_size, stat.st_ino, *self._cedar_versions(document),
                   *(p.exists() for p in self._missing_keys))
        self._cache = (version, document, digest.hexdigest())

    def _cedar_versions(self, document: PolicyDocument | None = None) -> tuple[tuple[int, int], ...]:
        """The Cedar files' versions: an edit to one is read like an edit to the TOML."""
        if document is None:
            document = self._cache[1] if self._cache is not None else None
        if document is None or self.path is None:
            return ()
        out = []
        for tenant in document.tenants.values():
            for path in cedar.tenant_files(tenant, self.path.parent):
                try:
                    st = path.stat()
                    out.append((st.st_mtime_ns, st.st_size))
                except OSError:
                    out.append((0, 0))
        return tuple(out)

    def policies(self, name: str) -> tuple[TenantPolicy | None, cedar.Policies | None, str]:
        """The tenant, the Cedar policies that decide for it (its own files', else its TOML rules
        exported) and the file's hash; None, None when the tenant is not in the file."""
        tenant, digest = self.tenant(name)
        if tenant is None:
            return None, None, digest
        return tenant, cedar.policies_of(name, tenant, self._cedar.get(name)), digest

    def tenant(self, name: str) -> tuple[TenantPolicy | None, str]:
        document, digest = self.load()
        if document is None:
            return policy.DEFAULT_TENANT_POLICY, digest
        return document.tenants.get(name), digest

    def signers(self) -> dict[str, Signer]:
        """The trusted signers (``[signers.NAME]``; none without a policy file)."""
        document, _ = self.load()
        return document.signers if document is not None else {}

    @property
    def source(self) -> str:
        return str(self.path) if self.path else DEFAULT_SOURCE

    @property
    def recorded_source(self) -> str:
        """The file as runs record it (with its hash beside it, in refs.policy_hash): relative to
        the worker's directory, never the machine's absolute path; a file elsewhere by its last
        two path parts."""
        if self.path is None:
            return DEFAULT_SOURCE
        resolved = self.path.resolve()
        try:
            return resolved.relative_to(Path.cwd().resolve()).as_posix()
        except ValueError:
            return Path(*resolved.parts[-2:]).as_posix()


def load_cedar_files(document: PolicyDocument, path: Path) -> dict[str, str]:
    """Each tenant's own Cedar files (``cedar = [...]``) as one text, checked against the schema;
    a problem is a :class:`PolicyFileError` naming the file, the line and the problem."""
    texts, problems = {}, []
    for name, tenant in document.tenants.items():
        if tenant.cedar is None:
            continue
        try:
            texts[name] = cedar.read_tenant_cedar(name, tenant, path.parent)
        except cedar.CedarFileError as e:
            problems += e.problems
    if problems:
        raise PolicyFileError("\n".join(problems))
    return texts


def resolve_key_files(document: PolicyDocument, path: Path, *, strict: bool = True) -> bool:
    """Fill in ``public_key`` from each approver's and signer's ``public_key_file`` (relative to
    the policy file). A file that cannot be read raises (``strict``: the worker's start check) or
    leaves the key unset (at run time: their signatures cannot verify). True when all were read."""
    complete = True
    holders: list[tuple[str, Approver | Signer]] = [(f"signers.{n}", s) for n, s in document.signers.items()]
    holders += [
        (f"tenants.{t}.approvers.{who}", a)
        for t, tenant in document.tenants.items()
        for who, a in (tenant.approvers or {}).items()
    ]
    for where, holder in holders:
        if holder.public_key_file is None or holder.public_key is not None:
            continue
        key_path = (path.parent / holder.public_key_file).resolve()
        try:
            holder.public_key = key_path.read_text().strip()
        except OSError as e:
            complete = False
            if strict:
                raise PolicyFileError(
                    f"{path}: key {where}.public_key_file: cannot read {key_path} ({e.strerror}; a relative "
                    f"path is read from the policy file's folder, {path.parent.resolve()}); point it at the key, "
                    "or make one with `tether keygen --out KEY.pem`"
                ) from None
    return complete


def _public_key_problem(value: str) -> str | None:
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        return "not valid base64"
    if len(raw) != 32:
        return f"decodes to {len(raw)} bytes; a raw Ed25519 public key is 32 (`tether keygen` prints one)"
    return None


def _loose_booleans(model: Any, raw: Any, loc: tuple[str | int, ...]) -> list[tuple[tuple[str | int, ...], Any]]:
    """Where ``raw`` (the TOML as written) gives a true/false setting of ``model`` something
    else (``four_eyes = "yes"``, which a lax parse would take as true): (key path, value)."""
    import typing

    from pydantic import BaseModel

    found: list[tuple[tuple[str | int, ...], Any]] = []
    if not isinstance(raw, dict) or not (isinstance(model, type) and issubclass(model, BaseModel)):
        return found
    hints = typing.get_type_hints(model)
    for name, info in model.model_fields.items():
        key = info.alias or name
        if key not in raw:
            continue
        value, hint = raw[key], hints.get(name)
        inner = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if hint is bool or inner == [bool]:
            if not isinstance(value, bool):
                found.append((loc + (key,), value))
        elif typing.get_origin(hint) is dict or any(typing.get_origin(a) is dict for a in inner):
            dict_hint = next(a for a in [hint, *inner] if typing.get_origin(a) is dict)
            item = typing.get_args(dict_hint)[1]
            for k, v in (value.items() if isinstance(value, dict) else []):
                found += _loose_booleans(item, v, loc + (key, k))
        else:
            for candidate in inner:
                found += _loose_booleans(candidate, value, loc + (key,))
    return found


def check_policy_file(path: Path, tool_names: Collection[str] | None) -> list[str]:
    """Everything wrong with a policy file as a whole, one line each (file, line, key): what
    the worker refuses to start on, and what ``tether policy validate`` reports (one check for
    both). Runtime reads (``PolicyStore``) only check the schema.

    ``tool_names``: every tool the worker serves (its registry, and any other tool sources);
    None: not known here (``tether policy validate``), tool names are not checked.
    """
    try:
        text = path.read_text()
    except (FileNotFoundError, IsADirectoryError):
        return [f"policy file not found: {path}"]
    problems: list[str] = []

    def problem(loc: tuple[str | int, ...], message: str) -> None:
        line = _locate(text, loc)
        problems.append(f"{path}: {f'line {line}, ' if line else ''}key {'.'.join(map(str, loc))}: {message}")

    try:
        document = parse_policy(text, str(path))
    except PolicyFileError as e:
        return str(e).splitlines()
    for loc, value in _loose_booleans(PolicyDocument, tomllib.loads(text), ()):
        problem(loc, f"must be true or false (a TOML boolean, unquoted), not {value!r}")
    try:
        resolve_key_files(document, path)
        load_cedar_files(document, path)
    except PolicyFileError as e:
        return problems + str(e).splitlines()

    if not document.tenants:
        problems.append(f"{path}: line 1, key tenants: no [tenants.NAME] table: every run would be refused (a missing "
                        "file, not an empty one, means the built-in default)")
    for name, signer in document.signers.items():
        at = ("signers", name)
        if not re.match(SIGNER_NAME, name):
            problem(at, f"a signer's name is lowercase letters, digits, '_', '.', '-' ({SIGNER_NAME})")
        if signer.public_key is None:
            problem(at, "no public_key or public_key_file: its attestations could never verify")
        elif why := _public_key_problem(signer.public_key):
            problem(at + ("public_key",), why)
        for tenant_name in signer.may_attest:
            if tenant_name not in document.tenants:
                problem(at + ("may_attest",), f"unknown tenant {tenant_name!r}")
    raw_tenants = tomllib.loads(text).get("tenants", {})
    known = set(tool_names or ())
    for hook_name, hook in document.notify.webhooks.items():
        if hook.secret_file is not None and not (path.parent / hook.secret_file).is_file():
            problem(("notify", "webhooks", hook_name, "secret_file"), f"no such file: {path.parent / hook.secret_file}")
    for name, tenant in document.tenants.items():
        at = ("tenants", name)
        if not raw_tenants.get(name):
            problem(at, "empty tenant: set tools and approvers (or remove it)")
            continue
        for level in ("normal", "high"):
            for i, stage in enumerate(getattr(tenant.escalation, level)):
                for hook_name in stage.notify:
                    if hook_name not in document.notify.webhooks:
                        problem(
                            at + ("escalation", level),
                            f"stage {i + 1} notifies {hook_name!r}: no [notify.webhooks.{hook_name}]",
                        )
        named: list[tuple[tuple[str | int, ...], str]] = [(at + ("tools",), t) for t in tenant.tools or []]
        named += [(at + ("auto_approve", "limits"), r.tool) for r in tenant.auto_approve.limits]
        named += [(at + ("high_risk", "when"), r.tool) for r in (tenant.high_risk.when if tenant.high_risk else [])]
        for loc, tool in named:
            if tool_names is not None and tool not in known:
                problem(loc, f"unknown tool {tool!r}; the worker has {', '.join(sorted(known)) or 'no tools'}")
        if tenant.tools == []:
            problem(at + ("tools",), "empty: this tenant may use no tool")
        if tenant.approvers is None:
            continue
        for who, approver in tenant.approvers.items():
            if approver.public_key is not None and (why := _public_key_problem(approver.public_key)):
                problem(at + ("approvers", who, "public_key"), why)
        # Two approvers people cannot tell apart (one UTS #39 skeleton): 'alice' and 'a1ice'.
        by_skeleton: dict[str, list[str]] = {}
        for who in tenant.approvers:
            by_skeleton.setdefault(skeleton(who), []).append(who)
        for alike in (names for names in by_skeleton.values() if len(names) > 1):
            problem(at + ("approvers", alike[1]), f"looks like approver {alike[0]!r}: people could not tell "
                    f"{' and '.join(map(repr, alike))} apart; rename one")
        held = {role for a in tenant.approvers.values() for role in a.roles}
        wanted = [("approval_roles", r) for r in tenant.approval_roles]
        wanted += [("high_risk", r) for r in (tenant.high_risk.roles if tenant.high_risk else [])]
        wanted += [
            ("escalation", r) for level in (tenant.escalation.normal, tenant.escalation.high) for st in level for r in st.roles
        ]
        for key, role in wanted:
            if role not in held:
                loc = at + (key,) if key in ("approval_roles", "escalation") else at + ("high_risk", "roles")
                problem(loc, f"role {role!r} is held by no approver: no plan needing it could be approved")
    return problems


def validate_file(path: Path) -> tuple[list[str], str]:
    """``tether policy validate``: a policy file (TOML, with the Cedar files its tenants name)
    or a Cedar file, checked against the schema. The problems (file, line, problem) and, when
    there are none, what was checked."""
    try:
        text = path.read_text()
    except OSError as e:
        return [f"{path}: cannot read it ({e.strerror})"], ""
    if path.suffix == ".cedar":
        return cedar.check_text(text, str(path))
    # Everything the worker would refuse (types, key files, Cedar files, roles, ...), but the
    # tool names: which tools a worker serves is the worker's (it checks them at start).
    problems = check_policy_file(path, None)
    if problems:
        return problems, ""
    document = parse_policy(text, str(path))
    own = load_cedar_files(document, path)
    exported = {name: cedar.export_tenant(name, t) for name, t in document.tenants.items() if name not in own}
    problems = [p for name, t in exported.items() for p in cedar.cedar_problems(t, f"{path} (tenant {name}, exported)")]
    return problems, (
        f"{len(document.tenants)} tenant(s): {len(exported)} decided by their TOML rules (exported to Cedar), "
        f"{len(own)} by their own Cedar files; all valid against the schema"
    )
