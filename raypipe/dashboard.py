"""raypipe's Grafana dashboard: one panel list, written as JSON beside Ray's bundled dashboards.

`python -m raypipe.dashboard > dashboards/raypipe_grafana_dashboard.json` writes
it (a test checks the file is current); import it in Grafana next to the
dashboards Ray writes under `/tmp/ray/session_latest/metrics/grafana/`. It uses
the same `${datasource}` variable as Ray's. docs/metrics.md (`python -m
raypipe.docs`) lists the same panels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Panel:
    stage: str
    title: str
    unit: str
    expr: str
    legend: str
    description: str


RUN = 'run=~"$run"'
APP = 'application="raypipe_hidden_states"'
PANELS = (
    Panel(
        "data",
        "Rows prepared / s",
        "rows/s",
        "sum(rate(ray_raypipe_data_rows_total[1m])) by (source)",
        "{{source}}",
        "Input rows through the data stage's actors, by dataset.",
    ),
    Panel(
        "data",
        "Rows kept / s",
        "rows/s",
        "sum(rate(ray_raypipe_data_rows_kept_total[1m])) by (source)",
        "{{source}}",
        "Prepared rows written (a multi-turn input row may give several).",
    ),
    Panel(
        "data",
        "Tokens prepared / s",
        "tokens/s",
        "sum(rate(ray_raypipe_data_tokens_total[1m])) by (source)",
        "{{source}}",
        "Tokens in the prepared rows written.",
    ),
    Panel(
        "data",
        "Rejected rows",
        "rows",
        "sum(ray_raypipe_data_rejects_total) by (reason)",
        "{{reason}}",
        "Rows refused, by reason code (written with the reason under rejects/).",
    ),
    Panel(
        "serve",
        "Service requests / s",
        "req/s",
        "sum(rate(ray_raypipe_serve_requests_total[1m])) by (method)",
        "{{method}}",
        "Extraction and generation requests to the hidden-state service.",
    ),
    Panel(
        "serve",
        "Service tokens / s",
        "tokens/s",
        "sum(rate(ray_raypipe_serve_tokens_total[1m])) by (method)",
        "{{method}}",
        "Tokens through the target engine.",
    ),
    Panel(
        "serve",
        "Service latency p50 / p95",
        "s",
        "histogram_quantile(0.95, sum(rate(ray_raypipe_serve_latency_s_bucket[5m])) by (le, method))",
        "p95 {{method}}",
        "Request latency at the replica (p95; p50 in the panel's second query).",
    ),
    Panel(
        "serve",
        "Extraction queue",
        "requests",
        "sum(ray_raypipe_serve_queue_depth)",
        "queued",
        "Extraction requests waiting for the engine, all replicas.",
    ),
    Panel(
        "serve",
        "Service replicas",
        "replicas",
        f"sum(ray_serve_deployment_replica_healthy{{{APP}}})",
        "healthy replicas",
        "Healthy replicas of the service (autoscaled between serve.min_replicas and max_replicas).",
    ),
    Panel(
        "serve",
        "Parity canary",
        "ok",
        "min(ray_raypipe_serve_canary_ok)",
        "canary ok",
        "1 when the last start-up canary matched the transformers reference.",
    ),
    Panel(
        "train",
        "Loss",
        "",
        f"ray_raypipe_train_loss{{{RUN}}}",
        "{{run}}",
        "Training loss (KL to the target), mean over the last logged interval.",
    ),
    Panel(
        "train",
        "Estimated acceptance length",
        "tokens",
        f"ray_raypipe_train_tau_estimate{{{RUN}}}",
        "{{run}}",
        "τ estimated from the last logged interval's draft accuracy (random anchors).",
    ),
    Panel(
        "train",
        "Acceptance length in vLLM during training",
        "tokens",
        f"ray_raypipe_train_vllm_tau{{{RUN}}}",
        "{{run}} T={{temperature}}",
        "τ of the current drafter measured in vLLM every eval.every_steps steps and at each checkpoint (the "
        "checkpoints' score; below eval.min_tau it stops the run).",
    ),
    Panel(
        "train",
        "Draft accuracy by position",
        "",
        f"ray_raypipe_train_accuracy{{{RUN}}}",
        "position {{position}}",
        "Accuracy of each block position over the last logged interval.",
    ),
    Panel(
        "train",
        "Trainer wait for hidden states",
        "percentunit",
        f"ray_raypipe_train_wait_fraction{{{RUN}}}",
        "{{run}}",
        "Share of a step spent waiting for the service: high means the service should scale up.",
    ),
    Panel(
        "train",
        "Training tokens / s",
        "tokens/s",
        f"ray_raypipe_train_tokens_per_s{{{RUN}}}",
        "{{run}}",
        "Tokens trained per second, all workers.",
    ),
    Panel(
        "train",
        "Steps / min",
        "steps/min",
        f"sum(rate(ray_raypipe_train_steps_total{{{RUN}}}[5m])) * 60",
        "{{run}}",
        "Optimizer steps per minute.",
    ),
    Panel(
        "train",
        "Skipped non-finite steps",
        "steps",
        f"sum(ray_raypipe_train_nonfinite_steps_total{{{RUN}}}) by (run)",
        "{{run}}",
        "Steps skipped for a NaN/Inf loss or gradient norm (train.run.max_nonfinite_steps in a row stop the run).",
    ),
    Panel("train", "Learning rate", "", f"ray_raypipe_train_lr{{{RUN}}}", "{{run}}", "Warm-up then cosine."),
    Panel(
        "eval",
        "Acceptance length in vLLM",
        "tokens",
        f"ray_raypipe_eval_tau{{{RUN}}}",
        "{{method}} {{drafter}} T={{temperature}}",
        "τ measured by vLLM's counters (trained and untrained drafter) and by the offline replay.",
    ),
    Panel(
        "eval",
        "Generation speed with the drafter",
        "tokens/s",
        f"ray_raypipe_eval_tokens_per_s{{{RUN}}}",
        "T={{temperature}}",
        "vLLM tokens/s with the trained drafter (eval.json has the ratio to no drafter).",
    ),
)


def _panel(i: int, p: Panel) -> dict:
    targets = [{"refId": "A", "expr": p.expr, "legendFormat": p.legend}]
    if p.expr.startswith("histogram_quantile(0.95"):
        targets.append(
            {"refId": "B", "expr": p.expr.replace("0.95", "0.5", 1), "legendFormat": p.legend.replace("p95", "p50")}
        )
    return {
        "id": i + 1,
        "type": "timeseries",
        "title": f"[{p.stage}] {p.title}",
        "description": p.description,
        "datasource": "${datasource}",
        "gridPos": {"x": (i % 3) * 8, "y": (i // 3) * 8, "w": 8, "h": 8},
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "targets": targets,
    }


def dashboard() -> dict:
    return {
        "title": "raypipe",
        "uid": "raypipe",
        "tags": ["raypipe", "ray"],
        "schemaVersion": 27,
        "refresh": "10s",
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "hide": 2,
                    "current": {"selected": False},
                    "options": [],
                    "refresh": 1,
                },
                {
                    "name": "run",
                    "type": "query",
                    "datasource": "${datasource}",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "definition": "label_values(ray_raypipe_train_loss, run)",
                    "query": {"query": "label_values(ray_raypipe_train_loss, run)", "refId": "run"},
                    "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                    "options": [],
                    "refresh": 2,
                },
            ]
        },
        "panels": [_panel(i, p) for i, p in enumerate(PANELS)],
    }


if __name__ == "__main__":
    print(json.dumps(dashboard(), indent=1))
