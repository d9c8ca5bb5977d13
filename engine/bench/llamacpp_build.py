"""Build llama.cpp's benchmark tools (`llama-bench`, `llama-batched-bench`) from the carried source.

The source is `carry/llama.cpp-src.tar.xz` (made by `engine.bench.prepare_carry`); the build goes to a
work folder under /tmp (`SLIPSTREAM_BENCH_WORK` overrides it), so later device calls in the same lease
reuse it. A finished build can be packed into parts of at most 15 MiB (`pack`) that come back through
the device tool's $OUT and travel again in `carry/`, so a later lease unpacks instead of rebuilding.
Nothing built here is ever committed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

TARGETS = ("llama-bench", "llama-batched-bench")
PART_BYTES = 15 << 20
PACK_NAME = "llamacpp-bin.tar.xz"


def work_dir() -> Path:
    return Path(os.environ.get("SLIPSTREAM_BENCH_WORK", "/tmp/slipstream-bench"))


def cmake_flags(cuda: bool) -> list[str]:
    flags = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
             "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_HTML=OFF", "-DLLAMA_BUILD_APP=OFF", "-DGGML_NATIVE=ON"]
    if cuda:
        flags += ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"]
    return flags


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _stamp(src_tar: Path, cuda: bool) -> str:
    return f"{_digest(src_tar)} cuda={int(cuda)}"


def bin_dir(root: Path | None = None) -> Path:
    return (root or work_dir()) / "llama.cpp" / "build" / "bin"


def tools_ok(bins: Path) -> bool:
    """Both tools exist and start (`--help` exits without loading a model)."""
    for t in TARGETS:
        exe = bins / t
        if not exe.is_file():
            return False
        try:
            r = subprocess.run([str(exe), "--help"], capture_output=True, timeout=60, check=False,
                               env=tool_env(bins))
        except (OSError, subprocess.TimeoutExpired):
            return False
        if r.returncode not in (0, 1) or b"usage" not in (r.stdout + r.stderr).lower():
            return False
    return True


def tool_env(bins: Path) -> dict:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{bins}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    return env


def ensure_built(src_tar: Path, *, cuda: bool = True, jobs: int | None = None, packed: Path | None = None,
                 log_dir: Path | None = None, say=print) -> dict:
    """The tools' folder, building only when neither a stamped build nor a packed one is there."""
    root = work_dir() / "llama.cpp"
    bins = root / "build" / "bin"
    stamp_file = root / "build" / "slipstream-stamp"
    stamp = _stamp(src_tar, cuda)
    if stamp_file.is_file() and stamp_file.read_text() == stamp and tools_ok(bins):
        say(f"llama.cpp: reusing the build in {bins}")
        return {"bin_dir": str(bins), "how": "cached build", "seconds": 0.0, "stamp": stamp}
    if packed is not None and unpack(packed, bins) and tools_ok(bins):
        say(f"llama.cpp: unpacked a carried build from {packed}")
        stamp_file.write_text(stamp)
        return {"bin_dir": str(bins), "how": "carried build", "seconds": 0.0, "stamp": stamp}
    failed = work_dir() / "llama.cpp-build-failed"
    if failed.is_file() and failed.read_text().startswith(stamp):
        raise RuntimeError("llama.cpp: this source already failed to build in this lease (not retrying):\n"
                           + failed.read_text())
    t0 = time.perf_counter()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    with tarfile.open(src_tar, "r:xz") as tf:
        tf.extractall(root, filter="data")
    logs = log_dir or root
    logs.mkdir(parents=True, exist_ok=True)
    jobs = jobs or os.cpu_count() or 4
    steps = [["cmake", "-S", str(root), "-B", str(root / "build"), *cmake_flags(cuda)],
             ["ninja", "-C", str(root / "build"), f"-j{jobs}", *TARGETS]]
    for i, cmd in enumerate(steps):
        log = logs / ("llamacpp-cmake.log" if i == 0 else "llamacpp-build.log")
        say("llama.cpp: " + " ".join(cmd))
        with open(log, "w") as f:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
        if r.returncode != 0:
            tail = log.read_text(errors="replace").splitlines()[-30:]
            msg = f"llama.cpp build step failed ({cmd[0]}, exit {r.returncode}); log {log}:\n" + "\n".join(tail)
            failed.write_text(f"{stamp}\n{msg}")
            raise RuntimeError(msg)
    if not tools_ok(bins):
        raise RuntimeError(f"llama.cpp build finished but {', '.join(TARGETS)} do not start from {bins}")
    stamp_file.write_text(stamp)
    secs = time.perf_counter() - t0
    say(f"llama.cpp: built in {secs:.0f} s")
    return {"bin_dir": str(bins), "how": "built", "seconds": secs, "stamp": stamp,
            "cmake_flags": cmake_flags(cuda), "jobs": jobs}


def pack(bins: Path, out_dir: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """The tools and their shared libraries as `llamacpp-bin.tar.xz.NN` parts of at most `part_bytes`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    whole = out_dir / (PACK_NAME + ".tmp")
    with tarfile.open(whole, "w:xz", preset=6) as tf:
        for p in sorted(bins.iterdir()):
            if p.name in TARGETS or ".so" in p.name:
                tf.add(p, arcname=p.name)
    parts = []
    with open(whole, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
            part = out_dir / f"{PACK_NAME}.{i:02d}"
            part.write_bytes(block)
            parts.append(part)
    whole.unlink()
    return parts


def unpack(first_part_or_dir: Path, bins: Path) -> bool:
    """Join `llamacpp-bin.tar.xz.NN` parts (from a folder, or a given first part) into `bins`."""
    folder = first_part_or_dir if first_part_or_dir.is_dir() else first_part_or_dir.parent
    parts = sorted(folder.glob(PACK_NAME + ".[0-9][0-9]"))
    if not parts:
        return False
    bins.mkdir(parents=True, exist_ok=True)
    joined = bins.parent / (PACK_NAME + ".joined")
    with open(joined, "wb") as out:
        out.writelines(p.read_bytes() for p in parts)
    try:
        with tarfile.open(joined, "r:xz") as tf:
            tf.extractall(bins, filter="data")
    except (tarfile.TarError, OSError):
        return False
    finally:
        joined.unlink(missing_ok=True)
    for t in TARGETS:
        if (bins / t).exists():
            (bins / t).chmod(0o755)
    return True
