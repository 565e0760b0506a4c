from dataclasses import asdict, dataclass
from typing import Any

# A call whose result has not been pushed by then is looked up in the database, the source of truth.
# Here, beside the limits, so settings can check the heartbeat against it (no Django to import).
CALL_GRACE_SECONDS = 30.0


@dataclass(frozen=True)
class Limits:
    """What one job may use. Fixed when the job is created, stored on it, applied by the sandbox."""

    timeout: float
    memory_mb: int
    max_output_bytes: int
    max_tool_calls: int
    max_parallel_tool_calls: int
    max_processes: int
    max_file_mb: int
    max_open_files: int
    # Seconds of waiting on the client (client tools, approvals) not counted against ``timeout``.
    max_client_wait: float = 0.0

    @property
    def cpu_seconds(self) -> int:
        # CPU time can't exceed wall time by much on this many cores; the wall clock is the real cap.
        return int(self.timeout) + 5

    def guest(self) -> dict[str, int]:
        """The limits the sandbox's runner sets on itself, in the units ``setrlimit`` takes."""
        return {
            "memory_bytes": self.memory_mb << 20,
            "cpu_seconds": self.cpu_seconds,
            "max_processes": self.max_processes,
            "max_file_bytes": self.max_file_mb << 20,
            "max_open_files": self.max_open_files,
        }

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Limits":
        # A job stored before a field existed gets its default.
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
