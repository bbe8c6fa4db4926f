"""Server-wide sgl_pic settings, carried from the launcher to SGLang's scheduler processes.

SGLang spawns its scheduler as a fresh process; the one channel that reaches it without
touching SGLang's argument parser is the environment, so the settings travel as JSON there.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from sgl_pic.config import PicConfig

ENV_VAR = "SGLPIC_SETTINGS"  # not SGL_*: SGLang claims that prefix
BACKEND_NAME = "sgl_pic"


@dataclass(frozen=True)
class PicServerSettings:
    """config:          default PicConfig of every request (requests may override fields).
    chunk_cache_mb:  byte budget of the chunk KV store, MiB.
    model_path:      model directory (its fingerprint keys the chunk store)."""

    config: PicConfig
    chunk_cache_mb: int = 1024
    model_path: str = ""

    def to_env(self) -> None:
        os.environ[ENV_VAR] = json.dumps(
            {
                "config": asdict(self.config),
                "chunk_cache_mb": self.chunk_cache_mb,
                "model_path": self.model_path,
            }
        )

    @classmethod
    def from_env(cls) -> PicServerSettings:
        raw = os.environ.get(ENV_VAR)
        if raw is None:
            # Registered through the entry point without our launcher: library defaults.
            return cls(PicConfig())
        data = json.loads(raw)
        return cls(
            config=PicConfig(**data["config"]),
            chunk_cache_mb=int(data["chunk_cache_mb"]),
            model_path=str(data["model_path"]),
        )
