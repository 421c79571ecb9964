"""Server settings, read from the environment (`BMEG_*`), e.g. `BMEG_MAX_SPANS=20000`.

Authentication is on by default: a server needs `BMEG_API_KEY` (non-empty) unless it is told
`BMEG_NO_AUTH=true` (`bmeg serve --no-auth`), for local use only. The limits bound what one
request may cost (bytes read and inflated, spans, traces, JSON nesting and number length,
the answer's size) and what the server keeps (recent diagnoses, in bytes); `bench/limits.py`
measures the server's memory at them.
"""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class TorchSettings(BaseSettings):
    """What the server and the consumer share (the consumer needs no API key)."""

    model_config = SettingsConfigDict(env_prefix="BMEG_", extra="ignore")

    torch_threads: int = Field(1, ge=1, description="PyTorch threads: small graphs run fastest on one.")


class ServingSettings(TorchSettings):

    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0, description="Largest request body accepted, after "
                                "decompression too (413 above).")
    max_spans: int = Field(50_000, gt=0, description="Most spans in one request (413 above).")
    max_traces: int = Field(2_000, gt=0, description="Most traces in one request (413 above): their answer must fit "
                            "in max_response_bytes (measured: up to ~5 KB per 25-span trace).")
    max_json_depth: int = Field(64, gt=0, description="Deepest nesting of a JSON body (400 above; OTLP/JSON needs ~12).")
    max_json_number_digits: int = Field(40, gt=0, description="Longest number in a JSON body, in digits (400 above).")
    max_response_bytes: int = Field(32 * 1024 * 1024, gt=0, description="Largest answer (413 above: send fewer traces).")
    recent_bytes: int = Field(64 * 1024 * 1024, ge=0, description="Memory the recent diagnoses may hold, in bytes "
                              "(the oldest are dropped first).")
    request_timeout_s: float = Field(30.0, gt=0, description="A diagnosis taking longer answers 504.")
    request_read_timeout_s: float = Field(30.0, gt=0, description="A client must send a request's headers and body "
                                          "within this many seconds of starting it (or of connecting); slower ones "
                                          "are disconnected.")
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="An idle kept-alive connection is closed after this.")
    max_connections: int = Field(1000, gt=0, description="Connections served at once (503 above).")
    api_key: SecretStr | None = Field(None, description="Required (X-API-Key) by requests that change state or show "
                                      "other users' data: POST /models/reload, GET /models, GET /diagnoses/*.")
    no_auth: bool = Field(False, description="Serve without an API key (local use only; `bmeg serve --no-auth`).")
    max_batch_spans: int = Field(20_000, gt=0, description="Most spans diagnosed in one model call (micro-batching).")
    split_spans: int = Field(2_000, gt=0, description="A request with more spans is diagnosed in parts of about this "
                             "many, each queued behind the requests that arrived meanwhile, so small requests are "
                             "not starved by a large one (window requests are never split).")
    batch_interval_ms: float = Field(10.0, ge=0, description="Under load, model calls start at most this often, "
                                     "so requests share them (an idle server answers at once).")
    recent_diagnoses: int = Field(50, ge=0, description="Diagnoses kept in memory for the web page.")

    @field_validator("api_key")
    @classmethod
    def _not_empty(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and not key.get_secret_value().strip():
            raise ValueError("BMEG_API_KEY is empty: set a real key (e.g. `openssl rand -hex 32`) or serve with --no-auth")
        return key

    @model_validator(mode="after")
    def _a_key_or_no_auth(self) -> ServingSettings:
        if self.api_key is None and not self.no_auth:
            raise ValueError("no API key: set BMEG_API_KEY (e.g. `export BMEG_API_KEY=$(openssl rand -hex 32)`), "
                             "or pass --no-auth (BMEG_NO_AUTH=true) to serve without one, for local use only")
        return self
