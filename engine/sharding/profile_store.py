"""The profile database file: where it lives, the hardware fingerprint that keys it, safe reads and writes.

One JSON file, `profile.json` in the user data folder (platformdirs app "Slipstream" where importable,
else ~/.local/share/slipstream; `SLIPSTREAM_DATA_DIR` overrides the folder, `SLIPSTREAM_PROFILE_DB` the
file). It holds up to `MAX_ENTRIES` profiles keyed by a hash of the hardware fingerprint (CPU model and
threads, GPU, driver, PCIe link, torch version, profile schema), newest first, and stays under 1 MB.
Writes go to a temporary file that replaces the old one, so a crash never leaves half a file; a file
that cannot be read is moved aside (`.corrupt`) and the profile is measured again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

SCHEMA = 1
MAX_ENTRIES = 8
MAX_FILE_BYTES = 1 << 20


def data_dir() -> Path:
    override = os.environ.get("SLIPSTREAM_DATA_DIR")
    if override:
        return Path(override)
    try:
        import platformdirs

        return Path(platformdirs.user_data_dir("Slipstream", appauthor=False))
    except ImportError:
        return Path.home() / ".local" / "share" / "slipstream"


def db_path() -> Path:
    override = os.environ.get("SLIPSTREAM_PROFILE_DB")
    return Path(override) if override else data_dir() / "profile.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvml_facts(index: int) -> dict:
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError):    # no driver library: leave the fields out
        return {}
    facts: dict = {}
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        drv = pynvml.nvmlSystemGetDriverVersion()
        facts["driver"] = drv.decode() if isinstance(drv, bytes) else str(drv)
        facts["pcie_gen"] = int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h))
        facts["pcie_width"] = int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(h))
    except pynvml.NVMLError:               # unsupported on this GPU: keep what was read
        pass
    finally:
        pynvml.nvmlShutdown()
    return facts


def fingerprint(device: str) -> dict:
    """What a profile was measured on; any change here means the profile no longer applies."""
    import torch

    from engine import kernels

    fp = {"schema": SCHEMA, "device": device, "cpu": _cpu_model(), "cpu_threads": os.cpu_count(),
          "torch_threads": torch.get_num_threads(), "torch": torch.__version__.split("+")[0],
          "cpu_matmul": kernels.status(wait=True)}
    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        props = torch.cuda.get_device_properties(index)
        fp.update(gpu=props.name, gpu_memory=int(props.total_memory),
                  capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda, **_nvml_facts(index))
    return fp


def fingerprint_key(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def load_db(path: Path) -> dict:
    """{"schema": 1, "profiles": {key: profile}}; empty when missing, of another schema, or unreadable."""
    empty = {"schema": SCHEMA, "profiles": {}}
    if not path.exists():
        return empty
    try:
        db = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(db, dict) or not isinstance(db.get("profiles"), dict):
            raise TypeError("no 'profiles' table")
    except (OSError, ValueError, TypeError) as exc:
        try:
            path.replace(path.with_suffix(path.suffix + ".corrupt"))
        except OSError:
            pass
        import logging

        logging.getLogger(__name__).warning("profile database %s unreadable (%s); measuring again", path, exc)
        return empty
    if db.get("schema") != SCHEMA:
        return empty
    return db


def save_profile(path: Path, key: str, profile: dict) -> None:
    """Insert `profile` under `key` as the newest entry; drop the oldest past MAX_ENTRIES or 1 MB."""
    db = load_db(path)
    _write(path, [(key, profile)] + [(k, v) for k, v in db["profiles"].items() if k != key])


def replace_profile(path: Path, key: str, profile: dict) -> None:
    """Replace the existing entry `key` in place (the other entries and their order unchanged)."""
    entries = list(load_db(path)["profiles"].items())
    if key not in dict(entries):
        raise KeyError(key)
    _write(path, [(k, profile if k == key else v) for k, v in entries])


def _write(path: Path, entries: list[tuple[str, dict]]) -> None:
    """The database of `entries` (newest first), oldest dropped past MAX_ENTRIES or 1 MB, written by a
    temporary file that replaces the old one."""
    entries = entries[:MAX_ENTRIES]
    while True:
        text = json.dumps({"schema": SCHEMA, "profiles": dict(entries)}, indent=1, sort_keys=False)
        if len(text.encode()) <= MAX_FILE_BYTES or len(entries) == 1:
            break
        entries.pop()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
