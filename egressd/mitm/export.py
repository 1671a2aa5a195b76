"""CA delivery (``EGRESSD_MITM_CA_EXPORT_DIR``): the public MITM CA certificate in a directory
the Fastlet bind-mounts into sandboxes, next to ``egressctl ca`` / ``GET /v1/mitm/ca``.

Two files with the same PEM bytes: :data:`PEM_NAME` (what ``curl --cacert``,
``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE`` and ``NODE_EXTRA_CA_CERTS`` take) and
:data:`CRT_NAME` (``update-ca-certificates`` only picks up ``*.crt``).

* **The certificate only.** What is written is the certificate parsed from the given PEM and
  serialised again, so a key block (or anything else) next to it can never be copied through;
  the CA key stays in ``EGRESSD_MITM_CONFDIR``, which must not overlap this directory.
* **Atomic.** Each file is written to a fresh temporary name in the same directory
  (``O_EXCL``, mode 0644 whatever the umask), fsynced, renamed over its name, then the
  directory is fsynced: a reader sees the previous certificate or the new one, never a part.
* **Stale files replaced.** Both names are rewritten when their content differs (a previous
  CA, a truncated or foreign file, a symlink: ``rename`` replaces the link, never its target),
  and temporary files an interrupted export left (:data:`TMP_PREFIX`\\*) are removed. No
  other file in the directory is touched: the directory may be shared.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import serialization

PEM_NAME: Final = "egressd-ca.pem"
CRT_NAME: Final = "egressd-ca.crt"
EXPORT_NAMES: Final = (PEM_NAME, CRT_NAME)
TMP_PREFIX: Final = ".egressd-ca-"
TMP_SUFFIX: Final = ".tmp"
FILE_MODE: Final = 0o644
DIR_MODE: Final = 0o755


class ExportError(Exception):
    """One-line reason the certificate cannot be exported (never carries key material)."""


def certificate_only(pem: str | bytes) -> bytes:
    """The first certificate of ``pem``, re-serialised as PEM (nothing else survives)."""
    data = pem.encode("ascii") if isinstance(pem, str) else pem
    try:
        cert = x509.load_pem_x509_certificate(data)
    except ValueError:
        raise ExportError("no PEM certificate to export") from None
    return cert.public_bytes(serialization.Encoding.PEM)


def _current(path: Path, want: bytes) -> bool:
    """True when ``path`` is already a regular 0644 file holding exactly ``want``."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or stat.S_IMODE(st.st_mode) != FILE_MODE or st.st_size != len(want):
        return False
    return path.read_bytes() == want


def _write_atomically(directory: Path, name: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=TMP_SUFFIX, dir=directory)
    try:
        try:
            os.fchmod(fd, FILE_MODE)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_temporaries(directory: Path) -> None:
    for entry in os.scandir(directory):
        if entry.name.startswith(TMP_PREFIX) and entry.name.endswith(TMP_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)  # a symlink is removed itself, never followed


def check_separate(export_dir: Path, confdir: Path) -> None:
    """Refuse an export directory that is, contains or lies inside the CA's private directory
    (resolved, so a symlink cannot hide it): mounting it would expose the CA key."""
    a, b = export_dir.resolve(), confdir.resolve()
    if a == b or b in a.parents or a in b.parents:
        raise ExportError(f"{export_dir} overlaps the MITM's private directory {confdir}")


def export_ca(directory: Path, pem: str | bytes) -> list[str]:
    """Write the certificate of ``pem`` into ``directory`` (created 0755 when missing; an
    existing one keeps its mode). Returns the names actually (re)written, empty when both
    were current. Raises :class:`ExportError`."""
    want = certificate_only(pem)
    written: list[str] = []
    try:
        if not directory.exists():
            directory.mkdir(parents=True, mode=DIR_MODE)
            # Sandboxes read it through a bind mount as another user: not the daemon's umask.
            os.chmod(directory, DIR_MODE)
        if not directory.is_dir():
            raise ExportError(f"{directory} is not a directory")
        _remove_stale_temporaries(directory)
        for name in EXPORT_NAMES:
            if not _current(directory / name, want):
                _write_atomically(directory, name, want)
                written.append(name)
        if written:
            _fsync_dir(directory)
    except FileExistsError:
        raise ExportError(f"{directory} is not a directory") from None
    except OSError as exc:
        raise ExportError(f"{directory}: {exc.strerror or exc}") from None
    return written
