"""CurveZMQ key files: each engine's key pair and the deployment's allow-list of public keys.

Files are zmq.auth certificates (``NAME.key`` public, ``NAME.key_secret`` secret, mode 0600).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from kvpush_prod.errors import ConfigError

logger = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
NAME_MAX = 64
# A name is a file stem and a metric label: keep it short, plain and never hidden (".x").
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_Z85_KEY_LEN = 40  # a 32-byte Curve25519 key in Z85
GENERATE_HINT = "`kvpush keys generate NAME --dir DIR`"


def check_name(name: str) -> str:
    """``name`` if it can name a key pair; ConfigError otherwise."""
    if not (0 < len(name) <= NAME_MAX and _NAME_RE.fullmatch(name)):
        raise ConfigError(
            f"key name {name!r} is not valid: use 1-{NAME_MAX} letters, digits, '.', '_' or "
            "'-', starting with a letter or digit (e.g. prefill-0)"
        )
    return name


def fingerprint(public: bytes | str) -> str:
    """A short, stable hex digest of a Z85 public key, for logs (never the key itself)."""
    if isinstance(public, str):
        public = public.encode("ascii", "replace")
    return hashlib.sha256(public).hexdigest()[:16]


@dataclass(frozen=True)
class KeyPair:
    """One engine's CurveZMQ identity: its name, Z85 public key (40 bytes) and secret key."""

    name: str
    public: bytes
    secret: bytes = field(repr=False)  # never in a log line or a traceback

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public)


@dataclass(frozen=True)
class Certificate:
    """What one certificate file holds: its name, public key, and secret key if any."""

    name: str
    public: bytes
    secret: bytes | None = field(repr=False)


def generate(
    name: str, directory: str | os.PathLike[str], force: bool = False
) -> tuple[Path, Path]:
    """Write a new key pair as ``DIR/NAME.key`` and ``DIR/NAME.key_secret`` (mode 0600).

    Refuses to replace existing files unless ``force``; returns (public path, secret path).
    """
    check_name(name)
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{directory}: cannot create the key directory ({exc.strerror}); choose a "
            "directory you can write to"
        ) from None
    if not directory.is_dir():
        raise ConfigError(f"{directory}: not a directory; give --dir a directory")
    public_path = directory / f"{name}{PUBLIC_SUFFIX}"
    secret_path = directory / f"{name}{SECRET_SUFFIX}"
    if not force:
        for path in (public_path, secret_path):
            if path.exists():
                raise ConfigError(
                    f"{path}: already exists; not replacing a key pair (every engine's "
                    "allow-list holds its public key). Choose another name, or pass --force "
                    "(force=True) to replace it and then update every allow-list"
                )
    # Written in a private (0700) directory next to the target and moved into place, so
    # the secret is never readable by others, not even between its creation and chmod.
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".kvpush-keys-", dir=directory))
    except OSError as exc:
        raise ConfigError(f"{directory}: cannot write there ({exc.strerror})") from None
    try:
        tmp_public, tmp_secret = (
            Path(p) for p in zmq.auth.create_certificates(tmp, name, metadata={"name": name})
        )
        os.chmod(tmp_secret, 0o600)
        _add_name(tmp_public, name)
        os.replace(tmp_secret, secret_path)
        os.replace(tmp_public, public_path)
    except OSError as exc:
        raise ConfigError(
            f"{directory}: cannot write the key pair {name} ({exc.strerror})"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return public_path, secret_path


def _add_name(public_path: Path, name: str) -> None:
    # pyzmq writes the metadata (our name) into the secret certificate only; the public one
    # gets it too, so that an allow-list file keeps its name whatever it is renamed to.
    text = public_path.read_text(encoding="utf-8")
    if "\nmetadata\n" in text:
        text = text.replace("\nmetadata\n", f"\nmetadata\n    name = {name}\n", 1)
        public_path.write_text(text, encoding="utf-8")


def _stem(path: Path) -> str:
    for suffix in (SECRET_SUFFIX, PUBLIC_SUFFIX):
        if path.name.endswith(suffix):
            return path.name[: -len(suffix)]
    return path.stem


def _metadata_name(path: Path) -> str | None:
    """The ``name`` in the certificate's ``metadata`` section (ZPL), if any."""
    section = ""
    with open(path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            if not line[0].isspace():
                section = stripped
                continue
            if section == "metadata" and "=" in stripped:
                key, value = (part.strip() for part in stripped.split("=", 1))
                if key == "name":
                    return value.strip("'\"")
    return None


def _check_key(path: Path, what: str, key: bytes) -> None:
    try:
        ok = len(key) == _Z85_KEY_LEN and len(z85.decode(key)) == 32
    except (ValueError, KeyError):  # pyzmq's z85 raises KeyError on a foreign character
        ok = False
    if not ok:
        raise ConfigError(
            f"{path}: the {what} is not a 40-character Z85 CurveZMQ key; the file is "
            f"corrupt or not a key file. Regenerate it with {GENERATE_HINT} (and update "
            "every allow-list)"
        )


def read_certificate(path: str | os.PathLike[str], role: str = "certificate") -> Certificate:
    """One certificate file, checked (keys well formed and matching, name valid)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(
            f"{path}: no such {role}. Create key pairs with {GENERATE_HINT}, or fix the path"
        )
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a {role}; give the file")
    try:
        public, secret = zmq.auth.load_certificate(path)
        name = _metadata_name(path) or _stem(path)
    except ValueError:
        raise ConfigError(
            f"{path}: no public-key in it: not a CurveZMQ certificate. Use the files "
            f"written by {GENERATE_HINT}"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the {role} ({exc.strerror or exc})") from None
    _check_key(path, "public key", public)
    if secret is not None:
        _check_key(path, "secret key", secret)
        if zmq.curve_public(secret) != public:
            raise ConfigError(
                f"{path}: the secret key does not belong to the public key beside it; the "
                f"file is corrupt or was edited. Regenerate it with {GENERATE_HINT} --force "
                "and update every allow-list"
            )
    try:
        check_name(name)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}; rename the file or fix its metadata name") from None
    return Certificate(name, public, secret)


def load_keypair(path: str | os.PathLike[str]) -> KeyPair:
    """The key pair in a secret certificate (``NAME.key_secret``); ConfigError if unusable."""
    path = Path(path)
    cert = read_certificate(path, "key file")
    if cert.secret is None:
        beside = path.with_name(_stem(path) + SECRET_SUFFIX)
        hint = (
            f"use {beside}"
            if beside.exists() and beside != path
            else f"use the {SECRET_SUFFIX} file written with it by {GENERATE_HINT}"
        )
        raise ConfigError(
            f"{path}: holds only a public key, but an engine's key file needs its secret "
            f"key: {hint} (the {PUBLIC_SUFFIX} file belongs in the allow-list)"
        )
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # Anyone who can read it can act as this engine (register for its transfers, take
        # their KV): refused, not warned about.
        raise ConfigError(
            f"{path}: mode {stat.S_IMODE(mode):04o} lets group or others read engine "
            f"{cert.name!r}'s secret key; make it readable by its owner only: chmod 600 "
            f"{path} (a Kubernetes secret volume: defaultMode: 0400)"
        )
    return KeyPair(cert.name, cert.public, cert.secret)


def load_allowed(path: str | os.PathLike[str]) -> dict[bytes, str]:
    """The allow-list: Z85 public key -> name, from a directory of ``*.key`` files or one file.

    ``*.key_secret`` files in the directory are ignored; a secret key in an allow-list file
    is refused (the allow-list is shared by every engine, a secret must not be).
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(
            f"{path}: no such allow-list. Give a directory holding every engine's public "
            f"{PUBLIC_SUFFIX} file (written by {GENERATE_HINT}), or one such file"
        )
    if path.is_dir():
        files = sorted(p for p in path.glob(f"*{PUBLIC_SUFFIX}") if p.is_file())
        if not files:
            secrets = any(path.glob(f"*{SECRET_SUFFIX}"))
            raise ConfigError(
                f"{path}: no public certificates (*{PUBLIC_SUFFIX}) in this allow-list "
                "directory"
                + (f" (only {SECRET_SUFFIX} files, which stay on their engine)" if secrets else "")
                + f"; copy every engine's NAME{PUBLIC_SUFFIX} there"
            )
    else:
        files = [path]
    allowed: dict[bytes, str] = {}
    where: dict[bytes, Path] = {}
    for file in files:
        cert = read_certificate(file, "public certificate")
        if cert.secret is not None:
            raise ConfigError(
                f"{file}: holds a secret key, but an allow-list is shared with every engine: "
                f"put only the public {PUBLIC_SUFFIX} files there and keep the "
                f"{SECRET_SUFFIX} on its engine"
            )
        known = allowed.get(cert.public)
        if known is not None and known != cert.name:
            raise ConfigError(
                f"{file}: its key is already in the allow-list as {known!r} (from "
                f"{where[cert.public]}), here named {cert.name!r}: one key, one name. Remove "
                "one of the two files"
            )
        allowed[cert.public] = cert.name
        where[cert.public] = file
    return allowed
