"""Where the run store lives: a local folder, a shared POSIX mount, or an object store, through fsspec (issue 17).

``Store.open(uri)`` takes ``storage.root`` as the user gave it: a path (``runs``, ``/mnt/shared/runs``,
``file:///...``) or an object store URI (``s3://bucket/prefix``; ``gs://`` and ``az://`` where fsspec has the
driver). Everything the run store does goes through the few operations below, each of them one the object
store itself provides; none is a rename:

- ``read_bytes`` / ``write_bytes``: whole objects (a local write goes through a temporary file and
  ``os.replace``, so a reader sees the old or the new file, never half of one);
- ``create``: a create-only write, the commit point of a stage (S3 ``If-None-Match: *`` through s3fs's
  ``mode="create"``; locally a hard link, which fails when the name exists). Exactly one of several racing
  writers gets ``True``;
- ``replace_if``: an overwrite only while the object still has the tag the caller read (S3 ``If-Match``;
  locally a sha256 compared under ``flock``): how a lease is renewed or taken over (``storage.lease``);
- ``exists`` / ``ls``: asked of the server every time. fsspec caches listings, and a cached listing misses a
  file another client has just written (s3fs #657, #903), so every filesystem here is made with
  ``use_listings_cache=False`` and ``skip_instance_cache=True``.

Credentials never pass through here: s3fs (botocore) reads the AWS variables, profiles and
``AWS_ENDPOINT_URL`` from the environment, and a URI that carries a key (``s3://key:secret@bucket``) is
refused. ``describe`` is what logs, ``run.json`` and MLflow may show of a store.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from solrl.config import ConfigError

#: The variables an S3 store reads, and the one ``AWS_ENDPOINT_URL`` (botocore's own) that points it at an
#: S3-compatible server; ``AWS_ENDPOINT_URL_S3`` wins over it, as in botocore.
ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
CREDENTIAL_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and AWS_ENDPOINT_URL for an S3-compatible server"
)


class StoreError(ConfigError):
    """The run store cannot be used as given: a bad URI, an endpoint that does not answer, no credentials, no
    such bucket, access denied. The message names the URI (never a credential) and what to set."""


def s3_endpoint() -> str | None:
    """The S3 endpoint the environment names (``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``), or None for
    AWS itself. pyarrow's S3 filesystem does not read these (apache/arrow #49643); ``arrow_filesystem`` passes
    it on."""
    return next((os.environ[name] for name in ENDPOINT_ENV if os.environ.get(name)), None)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fsync_dir(path: str | Path) -> None:
    """fsync a folder, so a file created, renamed or removed in it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Store:
    """A run store root on one filesystem.

    Attributes:
        uri: the root as a URL without credentials (``file:///abs/runs``, ``s3://bucket/prefix``).
        fs: the fsspec filesystem (listing cache off).
        root: the root as ``fs`` spells paths (``/abs/runs``, ``bucket/prefix``), no trailing slash.
    """

    uri: str
    fs: AbstractFileSystem
    root: str

    @classmethod
    def open(cls, uri: str | Path, **storage_options: Any) -> Store:
        """The store at ``uri`` (a path, ``file://`` URL or fsspec URL). Makes no request.

        ``storage_options`` go to the fsspec filesystem (tests pass ``client_kwargs``); credentials belong in
        the environment, not here.

        Raises:
            StoreError: a URI with credentials in it, a protocol fsspec does not know or cannot import, or an
                object store URI without a bucket.
        """
        text = os.fspath(uri)
        parts = urlsplit(text)
        protocol = parts.scheme if len(parts.scheme) > 1 else ""  # "C:\\" is not a protocol
        if protocol in ("", "file", "local"):
            local = parts.path if protocol else text
            root = str(Path(local).expanduser().resolve())
            return cls(Path(root).as_uri(), LocalFileSystem(), root)
        if parts.password or parts.username:
            raise StoreError(
                f"storage.root {parts.scheme}://...@{parts.hostname}/{parts.path.lstrip('/')} carries credentials; "
                f"give s3://bucket/prefix and {CREDENTIAL_HINT}"
            )
        if not parts.netloc:
            raise StoreError(f"storage.root {text!r} names no bucket; give {protocol}://bucket/prefix")
        import fsspec

        options: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True}
        if protocol in ("s3", "s3a"):
            protocol = "s3"
            if endpoint := s3_endpoint():
                options["endpoint_url"] = endpoint
        try:
            fs = fsspec.filesystem(protocol, **{**options, **storage_options})
        except (ImportError, ValueError) as exc:
            raise StoreError(f"storage.root {text!r}: no filesystem for {protocol}:// ({exc})") from None
        root = f"{parts.netloc}{parts.path}".rstrip("/")
        return cls(f"{protocol}://{root}", fs, root)

    @property
    def local(self) -> bool:
        """True for a folder this machine mounts (renames and ``flock`` work; files open as paths)."""
        return isinstance(self.fs, LocalFileSystem)

    @property
    def address(self) -> str:
        """What names this store to ``open`` (``storage.root``, ``--store``, another process's ``open_run``): a
        local folder's path, else the URI."""
        return self.root if self.local else self.uri

    def path(self, key: str = "") -> str:
        """``key`` (``/``-separated, relative to the root) as ``fs`` spells it."""
        return f"{self.root}/{key}".rstrip("/") if key else self.root

    def url(self, key: str = "") -> str:
        """``key`` as a URL without credentials, for messages and records."""
        return f"{self.uri}/{key}".rstrip("/") if key else self.uri

    def describe(self) -> str:
        """What may be shown of this store: a local folder's path, or the URL and, for S3, the endpoint (no
        credential ever)."""
        if self.local:
            return self.root
        endpoint = getattr(self.fs, "endpoint_url", None)
        return f"{self.uri} (endpoint {endpoint})" if endpoint else self.uri

    # Engines reading in place ---------------------------------------------------------------------------------

    def arrow_filesystem(self) -> Any:
        """A ``pyarrow.fs`` filesystem on this store, for ``pyarrow.parquet.read_table(store.path(key),
        filesystem=...)``: pyarrow's own ``S3FileSystem`` with the endpoint of ``s3_endpoint`` passed on (it reads
        the AWS credentials and region itself, but not ``AWS_ENDPOINT_URL``: apache/arrow #49643), else
        fsspec's filesystem wrapped for pyarrow (local folders, ``gs://``, ``az://``).
        """
        import pyarrow.fs

        if self.uri.startswith("s3://"):
            endpoint = s3_endpoint()
            options: dict[str, Any] = {}
            if endpoint is not None:
                parts = urlsplit(endpoint)
                options = {"endpoint_override": parts.netloc or endpoint, "scheme": parts.scheme or "https"}
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            return pyarrow.fs.S3FileSystem(region=region, **options) if region else pyarrow.fs.S3FileSystem(**options)
        return pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(self.fs))

    def zarr_store(self, key: str) -> Any:
        """A read-only zarr-python store on the Zarr group at ``key``: ``zarr.storage.LocalStore`` for a folder,
        else ``zarr.storage.FsspecStore`` on this store's protocol (the endpoint passed on, the listing cache
        off), for ``zarr.open_group(...)`` or ``xarray.open_zarr(...)``."""
        import zarr.storage

        if self.local:
            return zarr.storage.LocalStore(self.path(key), read_only=True)
        options: dict[str, Any] = {"use_listings_cache": False}
        if self.uri.startswith("s3://") and (endpoint := s3_endpoint()):
            options["endpoint_url"] = endpoint
        return zarr.storage.FsspecStore.from_url(self.url(key), storage_options=options, read_only=True)

    # Reads ------------------------------------------------------------------------------------------------

    def read_bytes(self, key: str) -> bytes:
        """The whole object.

        Raises:
            FileNotFoundError: no such object.
        """
        return self.fs.cat_file(self.path(key))

    def exists(self, key: str) -> bool:
        """Whether the object exists now (asked of the server, never a cached listing)."""
        return self.fs.exists(self.path(key))

    def tag(self, key: str) -> str | None:
        """The object's version tag for ``replace_if``: the S3 ETag, or locally the content's sha256; None when
        there is no object."""
        try:
            if self.local:
                return _sha256(Path(self.path(key)).read_bytes())
            return str(self.fs.info(self.path(key), refresh=True)["ETag"])
        except FileNotFoundError:
            return None

    def ls(self, key: str = "") -> list[str]:
        """The names directly under ``key``, fresh from the server (empty when there is nothing), without the
        store's own temporaries (names that begin with a dot)."""
        try:
            entries = self.fs.ls(self.path(key), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        names = (str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)
        return sorted(n for n in names if not n.startswith("."))

    def modified(self, key: str) -> float:
        """When the object was last written, in seconds since the epoch (0.0 when the store does not say)."""
        try:
            if self.local:
                return os.stat(self.path(key)).st_mtime
            stamp = self.fs.info(self.path(key), refresh=True).get("LastModified")
            return stamp.timestamp() if hasattr(stamp, "timestamp") else 0.0
        except FileNotFoundError:
            return 0.0

    def sizes(self, key: str) -> dict[str, int]:
        """The size in bytes of every object under the prefix ``key``, by its name relative to ``key`` (one
        fresh listing; empty when there is nothing)."""
        base = self.path(key)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return {
            name[len(base) + 1 :]: int(info["size"])
            for name, info in found.items()
            if name.startswith(f"{base}/") and info.get("type", "file") == "file"
        }

    def get_file(self, key: str, local: Path) -> None:
        """Download the object ``key`` to the local file ``local`` (written whole: a temporary file, then
        ``os.replace``).

        Raises:
            FileNotFoundError: no such object.
        """
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            self.fs.get_file(self.path(key), str(tmp))
            os.replace(tmp, local)
        finally:
            _unlink(str(tmp))

    # Writes -----------------------------------------------------------------------------------------------

    def write_bytes(self, key: str, data: bytes) -> str:
        """Write the whole object; readers see the old or the new one, never part. Returns its tag.

        Raises:
            OSError: the store refused the write (full, read-only, access denied).
        """
        path = self.path(key)
        if not self.local:
            out = self.fs.pipe_file(path, data)
            return _etag(out) or str(self.fs.info(path, refresh=True)["ETag"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = self._local_tmp(path, data)
        try:
            os.replace(tmp, path)
        finally:
            _unlink(tmp)
        fsync_dir(os.path.dirname(path))
        return _sha256(data)

    def create(self, key: str, data: bytes) -> str | None:
        """Write the object only if no object of that name exists: the commit point of a stage and of a lease.

        Of several writers racing for one name, exactly one gets its tag back and the others get None, on a
        server that decides conditional writes atomically (AWS S3 does; a local folder does, through
        ``link``). The object is complete when it appears.

        Raises:
            OSError: the store refused the write for another reason.
        """
        path = self.path(key)
        if not self.local:
            try:
                out = self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return None
            return _etag(out) or str(self.fs.info(path, refresh=True)["ETag"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = self._local_tmp(path, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return None
        finally:
            _unlink(tmp)
        fsync_dir(os.path.dirname(path))
        return _sha256(data)

    def replace_if(self, key: str, data: bytes, tag: str) -> str | None:
        """Overwrite the object only while its tag is still ``tag`` (compare-and-swap). Returns the new tag, or
        None when another writer changed or removed it first.

        Raises:
            OSError: the store refused the write for another reason.
        """
        path = self.path(key)
        if not self.local:
            try:
                out = self.fs.pipe_file(path, data, IfMatch=tag)
            except FileNotFoundError:
                return None
            except OSError as exc:  # s3fs maps a failed If-Match (412) to EINVAL
                if "precondition" in str(exc).lower() or getattr(exc, "errno", None) == 22:
                    return None
                raise
            return _etag(out) or str(self.fs.info(path, refresh=True)["ETag"])
        try:
            guard = os.open(os.path.dirname(path), os.O_RDONLY)  # flock on the folder: no file of its own
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
            if self.tag(key) != tag:
                return None
            return self.write_bytes(key, data)
        finally:
            os.close(guard)

    def delete(self, key: str) -> None:
        """Remove the object or everything under the prefix ``key`` (nothing when absent). Only for what no
        manifest names: an abandoned attempt, a probe."""
        try:
            self.fs.rm(self.path(key), recursive=True)
        except FileNotFoundError:
            pass

    def put_folder(self, local: Path, key: str) -> None:
        """Upload every file under the local folder ``local`` to the prefix ``key`` (one request per file).

        Raises:
            OSError: the store refused a write.
        """
        files = sorted(p for p in Path(local).rglob("*") if p.is_file())
        for path in files:
            rel = path.relative_to(local).as_posix()
            if self.local:
                target = Path(self.path(f"{key}/{rel}"))
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
            else:
                self.fs.put_file(str(path), self.path(f"{key}/{rel}"))

    def _local_tmp(self, path: str, data: bytes) -> str:
        """``data`` written and synced to a new temporary file beside ``path``; on a failed write (a full disk)
        the partial file is removed before the error propagates."""
        tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            _unlink(tmp)
            raise
        return tmp

    # Checks -----------------------------------------------------------------------------------------------

    def check(self, *, write: bool) -> None:
        """Fail fast, before any work, when the store cannot be used: one request to read the root and, with
        ``write``, a create-only probe object that is removed again. A local store is checked by the caller
        (it creates folders as it goes).

        Raises:
            StoreError: the endpoint does not answer, no credentials, no such bucket, access denied, or the
                server refuses a create-only write. The message names the URI and what to set.
        """
        if self.local:
            return
        probe = f".solrl-probe-{uuid.uuid4().hex[:12]}"
        # One try, a short connect timeout: a store that does not answer says so in seconds, not after retries.
        options = {**self.fs.storage_options, "skip_instance_cache": True}
        if self.uri.startswith("s3://"):
            options |= {"config_kwargs": {"connect_timeout": 5, "retries": {"max_attempts": 1}}}
        quick = Store(self.uri, type(self.fs)(**options), self.root)
        if hasattr(quick.fs, "retries"):
            quick.fs.retries = 1  # s3fs's own retry loop, around botocore's
        try:
            quick.fs.ls(self.root.split("/", 1)[0], refresh=True)
            if write:
                if quick.create(probe, b"probe") is None:
                    raise StoreError(f"{self.url(probe)} exists before it was written; the store is not private")
                quick.delete(probe)
        except StoreError:
            raise
        except Exception as exc:  # botocore's and aiohttp's own classes; named below by what they mean
            raise StoreError(self.explain(exc)) from None

    def explain(self, exc: BaseException) -> str:
        """One line saying why a request to this store failed and what to set (no credential in it); in a Ray
        task, also which node's environment to set (``ray_node_note``)."""
        return self._explain(exc) + ray_node_note()

    def _explain(self, exc: BaseException) -> str:
        name = type(exc).__name__
        text = str(exc)
        endpoint = getattr(self.fs, "endpoint_url", None) or "AWS"
        if "NoCredentials" in name or "credentials" in text.lower() and "unable to locate" in text.lower():
            return f"no credentials for {self.uri}: {CREDENTIAL_HINT}"
        if "EndpointConnection" in name or "Connect" in name or "connect" in text.lower():
            return f"cannot reach the object store for {self.uri} at {endpoint}; check AWS_ENDPOINT_URL"
        if isinstance(exc, FileNotFoundError) or "NoSuchBucket" in text:
            bucket = self.root.split("/", 1)[0]
            return f"bucket {bucket!r} of {self.uri} does not exist at {endpoint}; create it or fix storage.root"
        if isinstance(exc, PermissionError) or "AccessDenied" in text or "InvalidAccessKeyId" in text:
            return (
                f"access denied to {self.uri} at {endpoint}: the key in use may not read and write there; give it "
                f"that permission, or {CREDENTIAL_HINT} to name one that has it"
            )
        return f"cannot use {self.uri} at {endpoint}: {name}: {text}"


def ray_node_note() -> str:
    """In a Ray task or actor (a shard task, a Ray Train worker), the words that say whose environment it has:
    that of its node's ``ray start``, not the launching shell's; else ``""``."""
    ray = sys.modules.get("ray")  # never imported here: only a process that runs Ray has it
    try:
        if ray is None or not ray.is_initialized() or ray.get_runtime_context().get_task_id() is None:
            return ""  # no Ray, or its driver (the campaign's process)
        node = ray.util.get_node_ip_address()
    except Exception:  # a Ray of another API: the message stays without the note
        return ""
    return (
        f" (in a Ray task on node {node}, whose environment is the one its `ray start` was given: set the variables "
        "there and restart that node's Ray)"
    )


def _etag(out: Any) -> str | None:
    return str(out["ETag"]) if isinstance(out, dict) and out.get("ETag") else None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
