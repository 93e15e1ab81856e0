"""``kvpush keys``: make engines' CurveZMQ key pairs, list an allow-list, check a key file.

Exit codes: 0 ok, 2 bad input (a bad name, an unusable file, a key not in the allow-list).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpush_prod.control import keys
from kvpush_prod.errors import ConfigError

EXIT_OK = 0
EXIT_INVALID = 2

REMINDER = """\
Each NAME.key_secret stays on its engine (control.key_file); never copy it elsewhere.
The NAME.key files form the allow-list: put them all in one directory shared by every
engine and the router (control.allowed_keys)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpush keys",
        description="CurveZMQ keys of the control channel: one key pair per engine, and an "
        "allow-list directory of every engine's public key.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser(
        "generate",
        help="write NAME.key (public) and NAME.key_secret (secret)",
        description="Write a key pair per NAME into DIR: NAME.key (public, for "
        "the allow-list) and NAME.key_secret (secret, mode 0600, for the engine).",
    )
    g.add_argument(
        "names",
        nargs="+",
        metavar="NAME",
        help="engine name: letters, digits, '.', '_', '-' (at most 64)",
    )
    g.add_argument(
        "--dir",
        required=True,
        type=Path,
        metavar="DIR",
        help="directory to write into (created if missing)",
    )
    g.add_argument(
        "--force",
        action="store_true",
        help="replace existing key files (then update every allow-list)",
    )
    ls = sub.add_parser(
        "list",
        help="one line per key in an allow-list directory",
        description="Name, fingerprint, public key, and whether the secret "
        "file is beside it, for every key file in DIR.",
    )
    ls.add_argument("dir", type=Path, metavar="DIR")
    c = sub.add_parser(
        "check",
        help="exit 0 if a key file loads and is in the allow-list",
        description="Load an engine's key file and the allow-list; exit 0 if "
        "the engine's public key is in it, 2 (with the reason) otherwise.",
    )
    c.add_argument(
        "--key-file",
        required=True,
        type=Path,
        metavar="F",
        help="the engine's NAME.key_secret (control.key_file)",
    )
    c.add_argument(
        "--allowed",
        required=True,
        type=Path,
        metavar="DIR",
        help="the allow-list directory or file (control.allowed_keys)",
    )
    return parser


def _generate(names: list[str], directory: Path, force: bool) -> int:
    for name in names:  # all names checked before anything is written
        keys.check_name(name)
    if len(set(names)) != len(names):
        raise ConfigError(f"a NAME is given twice in {' '.join(names)}: give each once")
    if not force:
        for name in names:
            for suffix in (keys.PUBLIC_SUFFIX, keys.SECRET_SUFFIX):
                path = directory / f"{name}{suffix}"
                if path.exists():
                    raise ConfigError(
                        f"{path}: already exists; nothing written. Choose another name, or "
                        "pass --force to replace it and then update every allow-list"
                    )
    for name in names:
        public, secret = keys.generate(name, directory, force=force)
        pair = keys.load_keypair(secret)
        print(
            f"{name}: wrote {public} (public) and {secret} (secret, mode 0600), "
            f"fingerprint {pair.fingerprint}"
        )
    print(REMINDER)
    return EXIT_OK


def _list(directory: Path) -> int:
    if not directory.is_dir():
        raise ConfigError(f"{directory}: not a directory; give the allow-list directory")
    stems = sorted(
        {p.name[: -len(keys.PUBLIC_SUFFIX)] for p in directory.glob("*.key")}
        | {p.name[: -len(keys.SECRET_SUFFIX)] for p in directory.glob("*.key_secret")}
    )
    if not stems:
        raise ConfigError(f"{directory}: no key files (*.key, *.key_secret) in it")
    ok = True
    rows: list[tuple[str, str, str, str]] = []
    for stem in stems:
        public_path = directory / f"{stem}{keys.PUBLIC_SUFFIX}"
        secret_path = directory / f"{stem}{keys.SECRET_SUFFIX}"
        try:
            if public_path.exists():
                cert = keys.read_certificate(public_path, "public certificate")
                secret = "no"
                if secret_path.exists():
                    pair = keys.load_keypair(secret_path)
                    if pair.public != cert.public:
                        raise ConfigError(
                            f"{secret_path}: holds a different key than {public_path}: they "
                            "are not one pair. Regenerate with --force, or remove the stale one"
                        )
                    secret = "yes"
            else:
                cert = keys.read_certificate(secret_path, "key file")
                secret = f"yes (no {stem}{keys.PUBLIC_SUFFIX} beside it)"
        except ConfigError as exc:
            print(f"kvpush keys list: {exc}", file=sys.stderr)
            ok = False
            continue
        rows.append((cert.name, keys.fingerprint(cert.public), cert.public.decode(), secret))
    if rows:
        width = max(len("NAME"), *(len(r[0]) for r in rows))
        print(f"{'NAME':<{width}}  {'FINGERPRINT':<16}  {'PUBLIC KEY':<40}  SECRET BESIDE")
        for name, fp, public, secret in rows:
            print(f"{name:<{width}}  {fp}  {public}  {secret}")
    return EXIT_OK if ok else EXIT_INVALID


def _check(key_file: Path, allowed_path: Path) -> int:
    pair = keys.load_keypair(key_file)
    allowed = keys.load_allowed(allowed_path)
    listed = allowed.get(pair.public)
    if listed is None:
        print(
            f"kvpush keys check: {key_file}: its public key ({pair.name}, fingerprint "
            f"{pair.fingerprint}) is not in the allow-list {allowed_path} ({len(allowed)} "
            f"keys): peers will refuse this engine. Copy its {pair.name}"
            f"{keys.PUBLIC_SUFFIX} into {allowed_path} on every engine and the router",
            file=sys.stderr,
        )
        return EXIT_INVALID
    print(
        f"ok: {key_file} ({pair.name}, fingerprint {pair.fingerprint}) is in the "
        f"allow-list {allowed_path} as {listed!r} ({len(allowed)} keys)"
    )
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args.names, args.dir, args.force)
        if args.command == "list":
            return _list(args.dir)
        return _check(args.key_file, args.allowed)
    except ConfigError as exc:
        print(f"kvpush keys {args.command}: {exc}", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
