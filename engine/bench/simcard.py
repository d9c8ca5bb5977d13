"""A simulated graphics card shared by processes through a folder, with pynvml's names, for dry runs.

Each process that "uses VRAM" writes its bytes to `<dir>/<pid>` (`SimCard.set_own(n)`); readers see the
device's used bytes as the sum over live processes and the total as the card's size (`<dir>/total`).
`SimCard(dir)` answers the NVML calls the monitor and the pollers make (memory info, the process lists,
process names), so the co-run's orchestration, the game stand-in's accounting and the monitor's budget
policy all run on a CPU-only machine exactly as they would against a GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

from monitor.fake_nvml import ERROR_CLASSES, NVMLError, error


class SimCard:
    def __init__(self, folder: str | Path, total: int | None = None):
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        if total is not None:
            (self.dir / "total").write_text(str(int(total)))
        for name, cls in ERROR_CLASSES.items():
            setattr(self, f"NVMLError_{name}", cls)
        self.NVMLError = NVMLError

    # ---- writers ---------------------------------------------------------------------------------
    def set_own(self, nbytes: int, name: str = "") -> None:
        p = self.dir / str(os.getpid())
        tmp = p.with_suffix(".tmp")
        tmp.write_text(f"{int(nbytes)} {name or Path(sys.argv[0]).name}")
        tmp.replace(p)

    def clear_own(self) -> None:
        (self.dir / str(os.getpid())).unlink(missing_ok=True)

    # ---- readers ---------------------------------------------------------------------------------
    def total(self) -> int:
        return int((self.dir / "total").read_text())

    def usage(self) -> dict[int, tuple[int, str]]:
        out = {}
        for p in self.dir.iterdir():
            if not p.name.isdigit():
                continue
            pid = int(p.name)
            try:
                os.kill(pid, 0)
                nbytes, _, name = p.read_text().partition(" ")
                out[pid] = (int(nbytes), name)
            except (ProcessLookupError, ValueError, FileNotFoundError):
                continue
            except PermissionError:
                pass
        return out

    # ---- the pynvml surface ----------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if not (self.dir / "total").is_file():
            raise error("DriverNotLoaded")

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i != 0:
            raise error("InvalidArgument")
        return 0

    def nvmlDeviceGetName(self, h: int) -> str:
        return "simulated card"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        total, used = self.total(), sum(b for b, _ in self.usage().values())
        return SimpleNamespace(total=total, used=used, free=max(0, total - used))

    def nvmlDeviceGetUtilizationRates(self, h: int):
        raise error("NotSupported")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int):
        raise error("NotSupported")

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int):
        raise error("NotSupported")

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=b, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
                for pid, (b, _) in self.usage().items()]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list[SimpleNamespace]:
        return []

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        info = self.usage().get(pid)
        if info is None:
            raise error("NotFound")
        return info[1]

    def nvmlSystemGetDriverVersion(self) -> str:
        return "sim"
