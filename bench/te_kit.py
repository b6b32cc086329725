"""Transformer Engine for a GPU machine without a network, carried in parts across a few commands.

The project's borrowed GPUs reach no package registry and take at most 64 MiB of files per command, the working tree
included (docs/development/benchmarks.md). Transformer Engine's CUDA 13 core wheel is 181 MiB (2.16.1), almost all
of it one shared library, and its PyTorch extension is a source distribution compiled against the installed torch.
This tool moves it anyway, with nothing but the standard library and PyPI's own files:

``pack`` (here, with a network; ``TE=2.16.1 make gpu-kit`` runs it)
    Takes the core wheel apart: the shared library is xz-compressed (507 MiB to 139 MiB) and cut into parts,
    and the rest stays a small wheel under the core's own name (its RECORD without the library). Writes ``.te/``
    (git-ignored), its ``SHA256SUMS``, ``plan.json`` and ``CALLS.md``: which files each command carries so that
    none exceeds the limit with the tree, the last one with ``.whl/`` and the session.
``stash`` (there, the command of every call but the last)
    Checks each carried file against ``SHA256SUMS`` and copies it to ``/tmp/solrl-te``, which outlives a command
    while the machine stays warm. Once the extension's source is there, starts its build in a new process session
    (a command's other processes end with it), which runs while the next parts travel.
``install`` (there, a step of ``bench/gpu_session.sh`` when ``.te/`` came along)
    Stashes the last parts, joins and decompresses the library, installs the wheels and the built extension into
    a target folder, and waits for the build to end first (up to ``--wait`` seconds).

Each step says what is missing, and from which call, rather than failing later in an import.

    python bench/te_kit.py pack --core transformer_engine_cu13-2.16.1-...whl --meta transformer_engine-2.16.1-...whl \\
        --sdist transformer_engine_torch-2.16.1.tar.gz        # here; the tree's size from git, .whl/ measured
    python3 bench/te_kit.py stash                                  # there, calls 1..n-1
    python3 bench/te_kit.py install --target /tmp/site-te          # there, in the last call
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

MIB = 2**20
#: What one command takes, the working tree included (the device tool's limit).
CALL_LIMIT_MIB = 64
#: Room left in each call for what the estimate of the tree misses (a changed file, the transfer's own rounding).
MARGIN_MIB = 3
#: A wheel member this big or bigger travels compressed in parts (the core's shared library); the rest stays a wheel.
BIG_MEMBER_BYTES = 8 * MIB
STASH = Path("/tmp/solrl-te")
SUMS = "SHA256SUMS"
PLAN = "plan.json"
LIBRARY = "library.tar.xz"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def _slim_wheel(core: Path, out: Path, library: Path) -> list[str]:
    """Write ``core`` without its big members to ``out`` (RECORD without their lines) and the big members, as a
    tar, xz-compressed at preset 9, to ``library``. Returns the big members' names.

    Raises:
        SystemExit: the wheel has no big member (nothing to carry in parts).
    """
    with zipfile.ZipFile(core) as wheel:
        big = [m for m in wheel.infolist() if m.file_size >= BIG_MEMBER_BYTES]
        if not big:
            raise SystemExit(f"te_kit: {core.name} has no member of {BIG_MEMBER_BYTES // MIB} MiB or more")
        names = {m.filename for m in big}
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as slim:
            for member in wheel.infolist():
                if member.filename in names:
                    continue
                data = wheel.read(member)
                if member.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(line for line in lines if line.split(",", 1)[0] not in names).encode()
                slim.writestr(member, data)
        tar_bytes = io.BytesIO()
        with tarfile.open(fileobj=tar_bytes, mode="w") as tar:
            for member in big:
                info = tarfile.TarInfo(member.filename)
                info.size, info.mode = member.file_size, 0o755
                with wheel.open(member) as src:
                    tar.addfile(info, src)
    raw = tar_bytes.getvalue()
    if shutil.which("xz"):  # several threads where the tool has them; the stream decompresses the same
        with library.open("wb") as compressed:
            subprocess.run(["xz", "-9", "-T0", "-c"], input=raw, stdout=compressed, check=True)
    else:
        library.write_bytes(lzma.compress(raw, preset=9))
    return sorted(names)


def part_sizes(library: int, first: int, final: int, tree_mib: float) -> list[int]:
    """The library's parts, one a call: the first call carries ``first`` bytes beside its part (the extension's
    source, so that its build starts early), the last ``final`` bytes (the session's wheels and the slim core), every
    call the tree; each under the limit less ``MARGIN_MIB``.

    Args:
        library: the compressed library's bytes.
        first: bytes the first call carries beside its part.
        final: bytes the last call carries beside its part.
        tree_mib: the working tree's MiB (tracked and untracked, not ignored, files).

    Returns:
        Each part's bytes, in order; call ``i`` carries part ``i``.

    Raises:
        SystemExit: the tree and what the first or the last call carries leave no room for a part.
    """
    room = int((CALL_LIMIT_MIB - MARGIN_MIB - tree_mib) * MIB)
    if room - first <= 0 or room - final <= 0:
        raise SystemExit(
            f"te_kit: the tree ({tree_mib:.1f} MiB) with {first / MIB:.1f} MiB in the first call or "
            f"{final / MIB:.1f} MiB in the last leaves no room in a {CALL_LIMIT_MIB} MiB call"
        )
    if library <= room - first - final:
        return [library]
    caps, left = [room - first], library - (room - first)
    while left > room - final:
        caps.append(room)
        left -= room
    return [*caps, left]


def tree_mib() -> float:
    """The MiB every command carries: the files git tracks here and the untracked ones it does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], capture_output=True, check=True
    ).stdout
    return sum(Path(name).stat().st_size for name in listed.decode().split("\0") if name and Path(name).is_file()) / MIB


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def pack(args: argparse.Namespace) -> None:
    """Write ``--out``: the core's slim wheel, its library's parts, the meta wheel, the extension's source,
    ``SHA256SUMS``, ``plan.json`` and ``CALLS.md`` (the calls, each under the limit).

    Raises:
        SystemExit: the core wheel has no big member, or the tree leaves no room for a part.
    """
    out = Path(args.out)
    tree = args.tree_mib if args.tree_mib is not None else tree_mib()
    final_name = Path(args.final).name
    if not Path(args.final).exists():
        raise SystemExit(f"te_kit: {args.final} (what the last call carries beside) is missing; make gpu-kit builds it")
    final_bytes = _bytes(Path(args.final))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    library = out / LIBRARY
    core, meta, sdist = Path(args.core).name, Path(args.meta).name, Path(args.sdist).name
    big = _slim_wheel(Path(args.core), out / core, library)  # pip reads a wheel's tags from its name: kept
    for path in (Path(args.meta), Path(args.sdist)):
        shutil.copy2(path, out / path.name)
    final = (out / core).stat().st_size + (out / meta).stat().st_size + final_bytes
    data = library.read_bytes()
    sizes = part_sizes(len(data), (out / sdist).stat().st_size, final, tree)
    offset = 0
    for i, size in enumerate(sizes, start=1):
        (out / f"part-{i}").write_bytes(data[offset : offset + size])
        offset += size
    library.unlink()
    files = sorted(p.name for p in out.iterdir())
    (out / SUMS).write_text("".join(f"{_sha256(out / name)}  {name}\n" for name in files))
    calls = [[f"part-{i}"] for i in range(1, len(sizes) + 1)]
    calls[0].insert(0, sdist)
    calls[-1] += [core, meta, final_name]
    plan = {"parts": len(sizes), "core": core, "meta": meta, "sdist": sdist, "big": big, "calls": calls}
    (out / PLAN).write_text(json.dumps(plan, indent=1) + "\n")
    lines = [f"# Transformer Engine in {len(calls)} calls, one after another", ""]
    for i, carried in enumerate(calls, start=1):
        last = i == len(calls)
        carry = [c if c == final_name else f"{out.name}/{c}" for c in carried] + [
            f"{out.name}/{n}" for n in (SUMS, PLAN)
        ]
        mib = tree + sum(final_bytes if c == final_name else (out / c).stat().st_size for c in carried) / MIB
        command = "bash bench/gpu_session.sh" if last else "python3 bench/te_kit.py stash"
        lines.append(f"{i}. ({mib:.0f} MiB with the tree) run(command={command!r}, carry={json.dumps(carry)},")
        lines.append(f"   timeout_s={600 if last else 60})")
    lines += ["", "The machine goes back 30 s after a call, and the stash with it: make the next call at once."]
    (out / "CALLS.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _read_sums(source: Path) -> dict[str, str]:
    """``SHA256SUMS`` of ``source`` as file name -> digest.

    Raises:
        SystemExit: it is not there.
    """
    sums = source / SUMS
    if not sums.is_file():
        raise SystemExit(f"te_kit: no {sums} (carry it with every call)")
    return {name: digest for digest, name in (line.split(None, 1) for line in sums.read_text().splitlines())}


def _nvidia_include_dirs() -> list[str]:
    """The include folders of the CUDA libraries pip installed beside torch (``nvidia/*/include``): the extension
    includes cuDNN's and NCCL's headers, which a CUDA toolkit's own include folder lacks, and TE's build looks in
    these only where it finds no toolkit."""
    try:
        import nvidia  # a namespace package of pip's CUDA wheels
    except ImportError:
        return []
    return sorted(str(p) for base in nvidia.__path__ for p in Path(base).glob("*/include") if p.is_dir())


def _start_build(sdist: Path, kept: Path) -> None:
    """Build the PyTorch extension's wheel from its source into ``kept/dist`` in a new process session, so that it
    outlives this command (the machine ends a command's other processes) and runs while the next parts travel.
    ``-I`` folders of TE's build come first, so a toolkit's headers win over pip's where both have one."""
    (kept / "dist").mkdir(exist_ok=True)
    env = {**os.environ, "NVTE_PYTORCH_FORCE_BUILD": "TRUE", "MAX_JOBS": str(os.cpu_count() or 8)}
    # torch builds with ninja, in parallel, only where it finds it: pip's ninja sits beside this Python.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    headers = [*_nvidia_include_dirs(), *filter(None, os.environ.get("CPLUS_INCLUDE_PATH", "").split(":"))]
    if headers:
        env["CPLUS_INCLUDE_PATH"] = ":".join(headers)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w"]
    command += [str(kept / "dist"), str(sdist)]
    with (kept / "build.log").open("w") as log:
        log.write(f"CPLUS_INCLUDE_PATH={env.get('CPLUS_INCLUDE_PATH', '')}\n$ {' '.join(command)}\n")
        log.flush()
        subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stash(args: argparse.Namespace) -> dict:
    """Copy the carried files that match ``SHA256SUMS`` into the stash; start the extension's build once its source
    is there (``--no-build`` leaves it). Returns the plan.

    Raises:
        SystemExit: no ``SHA256SUMS`` came along, or a carried file does not match it.
    """
    source, kept = Path(args.source), Path(args.stash)
    sums = _read_sums(source)
    kept.mkdir(parents=True, exist_ok=True)
    for name in (SUMS, PLAN):
        shutil.copy2(source / name, kept / name)
    plan = json.loads((kept / PLAN).read_text())
    for name, digest in sums.items():
        carried, copy = source / name, kept / name
        if copy.is_file() and _sha256(copy) == digest:
            continue
        if carried.is_file():
            if _sha256(carried) != digest:
                raise SystemExit(f"te_kit: {carried} does not match {SUMS} (a partial copy?); carry it again")
            shutil.copy2(carried, copy)
    missing = sorted(n for n in sums if not (kept / n).is_file())
    started = (kept / "build.log").exists()
    if (kept / plan["sdist"]).is_file() and not started and not args.no_build:
        _start_build(kept / plan["sdist"], kept)
        started = True
    print(f"te_kit: {len(sums) - len(missing)} of {len(sums)} files in {kept}; missing: {', '.join(missing) or 'none'}")
    print(f"te_kit: the extension's build {'started' if started else 'not started'}")
    return plan


def install(args: argparse.Namespace) -> None:
    """Stash what this call carried, then install the core (its slim wheel, the library joined from its parts and
    decompressed), the meta package and the built extension into ``--target``.

    Raises:
        SystemExit: a part is missing (named with the call that carries it), or the extension was not built in time
            (with the end of its log).
    """
    plan = stash(args)
    kept = Path(args.stash)
    missing = [n for n in _read_sums(kept) if not (kept / n).is_file()]
    if missing:
        calls = {name: i for i, carried in enumerate(plan["calls"], start=1) for name in carried}
        where = ", ".join(f"{n} (call {calls.get(n, '?')})" for n in missing)
        raise SystemExit(f"te_kit: not in {kept}: {where}; the machine went back between calls, or a call was skipped")
    target = Path(args.target)
    target.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
    subprocess.run([*pip, "--target", str(target), str(kept / plan["core"]), str(kept / plan["meta"])], check=True)
    stream = lzma.LZMADecompressor()
    joined = b"".join(stream.decompress((kept / f"part-{i}").read_bytes()) for i in range(1, plan["parts"] + 1))
    with tarfile.open(fileobj=io.BytesIO(joined)) as tar:
        tar.extractall(target, filter="data")
    print(f"te_kit: core installed in {target} ({', '.join(plan['big'])}: {len(joined) / MIB:.0f} MiB)")
    if args.no_build:
        return
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline and not list((kept / "dist").glob("*.whl")):
        time.sleep(2)
    built = sorted((kept / "dist").glob("*.whl"))
    if not built:
        log = kept / "build.log"
        tail = log.read_text()[-3000:] if log.exists() else "(never started)"
        raise SystemExit(f"te_kit: the extension's wheel is not built after {args.wait:.0f} s; its log ends:\n{tail}")
    subprocess.run([*pip, "--target", str(target), str(built[0])], check=True)
    print(f"te_kit: extension installed ({built[0].name})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="take the wheels apart into .te/ (here)")
    p.add_argument("--core", required=True, help="transformer_engine_cu13-*.whl")
    p.add_argument("--meta", required=True, help="transformer_engine-*-py3-none-any.whl")
    p.add_argument("--sdist", required=True, help="transformer_engine_torch-*.tar.gz")
    p.add_argument("--out", default=".te")
    p.add_argument("--tree-mib", type=float, help="the working tree's MiB, carried with every call (default: git's)")
    p.add_argument("--final", default=".whl", help="the folder the last call carries beside (default: .whl)")
    s = sub.add_parser("stash", help="keep the carried files on the GPU machine; start the extension's build")
    i = sub.add_parser("install", help="join, decompress and install (the last call)")
    for verb in (s, i):
        verb.add_argument("--source", default=".te", help="where the call's carried files are")
        verb.add_argument("--stash", default=str(STASH), help="where they are kept between calls")
        verb.add_argument("--no-build", action="store_true", help="leave the extension unbuilt (a check without CUDA)")
    i.add_argument("--target", default="/tmp/site-te")
    i.add_argument("--wait", type=float, default=240, help="seconds to wait for the extension's build")
    args = parser.parse_args(argv)
    {"pack": pack, "stash": stash, "install": install}[args.verb](args)


if __name__ == "__main__":
    main()
