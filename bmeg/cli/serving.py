"""`bmeg serve` (the REST API and web page) and `bmeg consume` (the Kafka streaming consumer)."""

from __future__ import annotations

import logging
import signal
import threading
from functools import partial
from pathlib import Path

import click

from bmeg.serving.assembler import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_OPEN

model_option = click.option("--model", "run_dir", type=click.Path(path_type=Path), default=None,
                            help="Run directory of `bmeg train` (default: the cache's socialnet run).")
device_option = click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:1, ...")


def _limit_torch_threads() -> None:
    """Small graphs run fastest single-threaded; BMEG_TORCH_THREADS overrides (validated here)."""
    from bmeg.models.inference import limit_cpu_threads
    from bmeg.serving.settings import TorchSettings

    limit_cpu_threads(TorchSettings().torch_threads)


@click.command("serve")
@model_option
@device_option
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--log-level", default="info", show_default=True)
@click.option("--model-process/--in-process", default=False, show_default=True,
              help="Run the model in a child process of its own (a crash there does not take the server "
                   "down) or on a thread of the server (faster on 2 cores: see README, Results).")
@click.option("--no-auth", is_flag=True, help="Serve without an API key (local use only): anyone who reaches the "
                                              "server may reload the model and read every recent diagnosis.")
def serve(run_dir: Path | None, device: str, host: str, port: int, log_level: str, model_process: bool,
          no_auth: bool) -> None:
    """Serve POST /diagnose, the web page (/), /metrics, /healthz and /readyz.

    The API key (BMEG_API_KEY, sent as X-API-Key) guards POST /models/reload, GET /models and
    GET /diagnoses/*; without one the server refuses to start unless given --no-auth. Limits come
    from the environment (BMEG_MAX_BODY_BYTES, BMEG_MAX_SPANS, BMEG_MAX_TRACES, ...: see
    `bmeg.serving.settings` and the README).
    """
    import uvicorn
    from pydantic import ValidationError

    from bmeg.models.detector import Detector, default_run_dir
    from bmeg.serving.app import create_app
    from bmeg.serving.httpserver import config
    from bmeg.serving.model_process import ModelProcess
    from bmeg.serving.settings import ServingSettings

    try:
        settings = ServingSettings(**({"no_auth": True} if no_auth else {}))
    except ValidationError as error:
        raise click.ClickException("; ".join(e["msg"].removeprefix("Value error, ") for e in error.errors())) from None
    if settings.api_key is None:
        click.echo("WARNING: serving WITHOUT authentication (--no-auth): anyone who reaches this server may reload "
                   "the model and read every recent diagnosis. For local use only.", err=True)
    else:
        click.echo("authentication on: POST /models/reload, GET /models and GET /diagnoses/* need the X-API-Key "
                   "header", err=True)
    _limit_torch_threads()
    run_dir = run_dir or default_run_dir()
    loader = (partial(ModelProcess, run_dir, device, settings.torch_threads) if model_process
              else partial(Detector.load, run_dir, device=device))
    uvicorn.Server(config(create_app(loader, settings), host, port, settings, log_level=log_level)).run()


@click.command("consume")
@model_option
@device_option
@click.option("--bootstrap", required=True, help="Kafka bootstrap servers, HOST:PORT[,HOST:PORT].")
@click.option("--topic", default="otlp_spans", show_default=True, help="Topic of the spans.")
@click.option("--group", "group_id", default="bmeg-diagnoser", show_default=True, help="Consumer group.")
@click.option("--encoding", type=click.Choice(["auto", "otlp_proto", "otlp_json"]), default="auto", show_default=True,
              help="Encoding of messages without a content-type header (auto: detected from the bytes).")
@click.option("--diagnoses-topic", default="bmeg.diagnoses", show_default=True)
@click.option("--mitigations-topic", default="bmeg.mitigations", show_default=True)
@click.option("--dead-letter-topic", default="otlp_spans.dlq", show_default=True)
@click.option("--idle-timeout", "idle_timeout_s", type=float, default=DEFAULT_IDLE_TIMEOUT_S, show_default=True,
              help="Seconds without a new span after which an incomplete trace is finished (above the senders' "
                   "export interval: the OpenTelemetry SDKs export every 5 s).")
@click.option("--max-trace-spans", type=int, default=10_000, show_default=True, help="A trace is finished at this size.")
@click.option("--max-open-traces", type=click.IntRange(min=1), default=DEFAULT_MAX_OPEN, show_default=True,
              help="Traces assembled at once; beyond, the least recently touched is finished early (bounds memory).")
@click.option("--batch-traces", type=int, default=512, show_default=True, help="Traces diagnosed per model call.")
@click.option("--metrics-port", type=int, default=None, help="Serve /metrics and /healthz (liveness) on this port.")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="Address the metrics port binds (0.0.0.0 in a pod, for the probes).")
def consume(run_dir: Path | None, device: str, bootstrap: str, topic: str, group_id: str, encoding: str,
            diagnoses_topic: str, mitigations_topic: str, dead_letter_topic: str, idle_timeout_s: float,
            max_trace_spans: int, max_open_traces: int, batch_traces: int, metrics_port: int | None, metrics_host: str) -> None:
    """Diagnose every trace on a Kafka topic; publish diagnoses, forward bottlenecks. Stops on SIGTERM."""
    from bmeg.models.checkpoint import CheckpointError
    from bmeg.models.detector import Detector, default_run_dir
    from bmeg.serving.consumer import ConsumerConfig, StreamConsumer, serve_probes
    from bmeg.serving.publishing import PublishError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _limit_torch_threads()
    try:
        detector = Detector.load(run_dir or default_run_dir(), device=device)
    except CheckpointError as error:
        raise click.ClickException(str(error)) from error
    config = ConsumerConfig(
        bootstrap=bootstrap, topic=topic, group_id=group_id, encoding=None if encoding == "auto" else encoding,
        diagnoses_topic=diagnoses_topic, mitigations_topic=mitigations_topic, dead_letter_topic=dead_letter_topic,
        idle_timeout_s=idle_timeout_s, max_trace_spans=max_trace_spans, max_open_traces=max_open_traces,
        batch_traces=batch_traces,
    )
    consumer = StreamConsumer(detector, config)
    probes = serve_probes(consumer, metrics_host, metrics_port) if metrics_port is not None else None
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    click.echo(f"consuming {topic} on {bootstrap} as group {group_id} with {detector.version}", err=True)
    try:
        consumer.run(stop)
    except PublishError as error:
        raise click.ClickException(f"stopped, offsets not committed past the failed record: {error}") from error
    finally:
        if probes is not None:
            probes.shutdown()
    diagnosed = consumer.metrics.registry.get_sample_value("bmeg_consumer_traces_diagnosed_total")
    click.echo(f"stopped: published {diagnosed:.0f} diagnoses; pending traces published, offsets committed", err=True)
