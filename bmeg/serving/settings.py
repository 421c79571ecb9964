"""Server settings, read from the environment (`BMEG_*`), e.g. `BMEG_MAX_SPANS=20000`."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServingSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BMEG_", extra="ignore")

    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0, description="Largest request body accepted (413 above).")
    max_spans: int = Field(100_000, gt=0, description="Most spans in one request (413 above).")
    request_timeout_s: float = Field(30.0, gt=0, description="A diagnosis taking longer answers 504.")
    api_key: SecretStr | None = Field(None, description="When set, required (X-API-Key) by requests that change state.")
    max_batch_spans: int = Field(20_000, gt=0, description="Most spans diagnosed in one model call (micro-batching).")
    batch_interval_ms: float = Field(10.0, ge=0, description="Under load, model calls start at most this often, "
                                     "so requests share them (an idle server answers at once).")
    torch_threads: int = Field(1, ge=1, description="PyTorch threads: small graphs run fastest on one.")
    recent_diagnoses: int = Field(50, ge=0, description="Diagnoses kept in memory for the web page.")
