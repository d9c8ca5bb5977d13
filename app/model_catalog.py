"""Models the picker offers: the bundled default, and models found where other tools keep them — the
Hugging Face cache, LM Studio's and Ollama's model folders — plus folders the user added. Only file
names and small manifests are read; nothing is downloaded."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

BUNDLED_LABEL = "SmolLM2-135M-Instruct (bundled)"
MAX_FILES = 400


@dataclass(frozen=True, slots=True)
class ModelEntry:
    label: str
    source: str | None        # None = the bundled default; else a GGUF file or a Hugging Face folder
    origin: str               # "bundled" | "Hugging Face cache" | "LM Studio" | "Ollama" | "folder" | "chosen"


def discover_models(extra_dirs: list[str] | tuple[str, ...] = (), home: Path | None = None) -> list[ModelEntry]:
    home = home or Path.home()
    found: list[ModelEntry] = [ModelEntry(BUNDLED_LABEL, None, "bundled")]
    found += _huggingface_cache(home)
    for root in (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"):
        found += [ModelEntry(f"{p.stem} (LM Studio)", str(p), "LM Studio") for p in _ggufs(root)]
    found += _ollama(Path(os.environ.get("OLLAMA_MODELS") or home / ".ollama" / "models"))
    for d in extra_dirs:
        root = Path(d).expanduser()
        found += [ModelEntry(f"{p.stem}", str(p), "folder") for p in _ggufs(root)]
        found += [ModelEntry(p.name, str(p), "folder") for p in _hf_folders(root)]
    seen: set[str | None] = set()
    unique = []
    for entry in found:
        if entry.source not in seen:
            seen.add(entry.source)
            unique.append(entry)
    return unique


def _huggingface_cache(home: Path) -> list[ModelEntry]:
    hub = os.environ.get("HF_HUB_CACHE") or (Path(os.environ["HF_HOME"]) / "hub" if os.environ.get("HF_HOME")
                                             else home / ".cache" / "huggingface" / "hub")
    hub = Path(hub)
    entries: list[ModelEntry] = []
    if not hub.is_dir():
        return entries
    for repo in sorted(hub.glob("models--*"))[:MAX_FILES]:
        name = repo.name[len("models--"):].replace("--", "/")
        snapshots = [s for s in (repo / "snapshots").glob("*") if s.is_dir()]
        if not snapshots:
            continue
        latest = max(snapshots, key=lambda s: s.stat().st_mtime)
        if (latest / "config.json").is_file() and any(latest.glob("*.safetensors")):
            entries.append(ModelEntry(f"{name} (Hugging Face)", str(latest), "Hugging Face cache"))
        for gguf in sorted(latest.glob("*.gguf")):
            if "mmproj" not in gguf.name.lower():
                entries.append(ModelEntry(f"{name}/{gguf.stem} (Hugging Face)", str(gguf), "Hugging Face cache"))
    return entries


def _ggufs(root: Path, depth: int = 3) -> list[Path]:
    if not root.is_dir():
        return []
    out: list[Path] = []
    for level in range(depth + 1):
        for p in root.glob("/".join(["*"] * level + ["*.gguf"])):
            if "mmproj" not in p.name.lower():
                out.append(p)
            if len(out) >= MAX_FILES:
                return sorted(out)
    return sorted(out)


def _hf_folders(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    candidates = [root, *sorted(p for p in root.iterdir() if p.is_dir())[:MAX_FILES]]
    return [p for p in candidates if (p / "config.json").is_file() and any(p.glob("*.safetensors"))]


def _ollama(root: Path) -> list[ModelEntry]:
    manifests = root / "manifests"
    if not manifests.is_dir():
        return []
    entries: list[ModelEntry] = []
    for manifest in sorted(p for p in manifests.rglob("*") if p.is_file())[:MAX_FILES]:
        try:
            layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
        except (OSError, ValueError, AttributeError):
            continue
        for layer in layers:
            if layer.get("mediaType") == "application/vnd.ollama.image.model":
                blob = root / "blobs" / str(layer.get("digest", "")).replace(":", "-")
                if blob.is_file():
                    name = f"{manifest.parent.name}:{manifest.name}"
                    entries.append(ModelEntry(f"{name} (Ollama)", str(blob), "Ollama"))
    return entries


def label_for(source: str | None) -> str:
    if source is None:
        return BUNDLED_LABEL
    p = Path(source)
    return p.stem if p.suffix.lower() == ".gguf" else p.name
