"""Prepare, on this (networked) machine, what the GPU benchmark carries to the device machine.

    python -m engine.bench.prepare_carry [--dest carry] [--version 0.3.36]

Writes into DEST (git-ignored: `/carry/` is in .gitignore):
- `llama.cpp-src.tar.xz`: llama.cpp's source as vendored in the llama-cpp-python source distribution,
  stripped to what a CUDA build of `llama-bench` and `llama-batched-bench` needs (no docs, tests,
  examples, web UI, server, other GPU backends), plus two vocabulary-only GGUF files (Llama-3 and
  Qwen2 tokenizers) for realistic tokenizer metadata in the random-weight GGUFs.
- `gguf-*.whl`: the pure-Python `gguf` package, to write GGUF files there.
- `MANIFEST.json`: versions, sizes and hashes.

Nothing here is ever committed: the benchmark builds llama.cpp on the GPU machine from this source.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
MAX_CARRY_BYTES = 60 << 20
# Paths (relative to vendor/llama.cpp) that the build needs; then the parts of them it does not.
KEEP = ("CMakeLists.txt", "CMakePresets.json", "LICENSE", "licenses", "cmake", "ggml", "src", "include",
        "common", "tools", "vendor", "models/ggml-vocab-llama-bpe.gguf", "models/ggml-vocab-qwen2.gguf")
_OTHER_BACKENDS = ("cann", "et", "hexagon", "hip", "metal", "musa", "opencl", "openvino", "sycl", "virtgpu",
                   "vulkan", "webgpu", "zdnn", "zendnn")
DROP_PREFIXES = tuple(f"ggml/src/ggml-{b}/" for b in _OTHER_BACKENDS) + (
    "tools/ui/", "tools/server/", "tools/cli/")
DROP_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".mp4", ".md")


def keep_member(rel: str) -> bool:
    """Whether a path relative to vendor/llama.cpp goes into the stripped source."""
    if not any(rel == k or rel.startswith(k + "/") for k in KEEP):
        return False
    if any(rel.startswith(p) or rel + "/" == p for p in DROP_PREFIXES):
        return False
    return not rel.lower().endswith(DROP_SUFFIXES)


def strip_sdist(sdist: Path, out: Path) -> dict:
    """Copy the kept members of the sdist's vendor/llama.cpp into `out` (tar.xz, paths relative to it)."""
    n, raw = 0, 0
    with tarfile.open(sdist, "r:gz") as src, tarfile.open(out, "w:xz", preset=9) as dst:
        for m in src:
            parts = m.name.split("/", 3)            # llama_cpp_python-X/vendor/llama.cpp/<rel>
            if len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"] or not keep_member(parts[3]):
                continue
            if not (m.isfile() or m.isdir()):
                continue
            m2 = tarfile.TarInfo(parts[3])
            m2.size, m2.mode, m2.mtime, m2.type = m.size, m.mode, m.mtime, m.type
            if m.isfile():
                dst.addfile(m2, src.extractfile(m))
                n, raw = n + 1, raw + m.size
            else:
                dst.addfile(m2)
    return {"files": n, "uncompressed_bytes": raw}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pip_download(args: list[str], dest: Path) -> Path:
    before = set(dest.iterdir())
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), *args],
                   check=True)
    new = sorted(set(dest.iterdir()) - before) or sorted(dest.iterdir())
    return new[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default="carry", help="git-ignored folder to write into (default: carry)")
    ap.add_argument("--version", default=VERSION, help="llama-cpp-python version of the source distribution")
    ap.add_argument("--sdist", default=None, help="an already downloaded llama_cpp_python-*.tar.gz")
    args = ap.parse_args(argv)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        sdist = Path(args.sdist) if args.sdist else pip_download(
            ["--no-binary", ":all:", f"llama-cpp-python=={args.version}"], tmpd)
        src_out = dest / "llama.cpp-src.tar.xz"
        stats = strip_sdist(sdist, src_out)
        for old in dest.glob("gguf-*.whl"):
            old.unlink()
        wheel = pip_download(["--only-binary", ":all:", "gguf"], tmpd)
        wheel_out = dest / wheel.name
        wheel_out.write_bytes(wheel.read_bytes())
    manifest = {"llama_cpp_python": args.version, "source": {"file": src_out.name, **stats,
                                                              "bytes": src_out.stat().st_size,
                                                              "sha256": sha256(src_out)},
                "gguf_wheel": {"file": wheel_out.name, "bytes": wheel_out.stat().st_size}}
    (dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"{src_out}: {src_out.stat().st_size / 2**20:.1f} MiB ({stats['files']} files); {wheel_out.name}; "
          f"{dest} holds {total / 2**20:.1f} MiB in all")
    if total > MAX_CARRY_BYTES:
        print(f"warning: {dest} is over {MAX_CARRY_BYTES >> 20} MiB; the device tool carries 64 MiB at most",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
