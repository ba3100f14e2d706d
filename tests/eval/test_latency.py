"""The latency sweep's pure parts: the server's command line, the counters, each level's figures, the table."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from raypipe.eval.latency import level_summary, parse_counters, server_command
from raypipe.eval.report import latency_table, plot_latency


def test_engine_options_become_the_servers_flags() -> None:
    engine = {
        "model": "/m",
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "disable_log_stats": False,
        "kv_cache_memory_bytes": 1 << 30,
        "limit_mm_per_prompt": {"image": 0},
    }
    cmd = server_command(engine, {"method": "dflash", "model": "/d"}, 8001)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and cmd[cmd.index("--port") + 1] == "8001"
    assert "--enforce-eager" in cmd and "--no-enable-prefix-caching" in cmd
    assert not any("log-stats" in c for c in cmd)  # a store-true flag left off
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)
    assert cmd[cmd.index("--limit-mm-per-prompt") + 1] == '{"image": 0}'
    assert cmd[cmd.index("--speculative-config") + 1] == '{"method": "dflash", "model": "/d"}'
    assert "--speculative-config" not in server_command(engine, None, 8001)


def test_counters_are_summed_over_label_sets() -> None:
    page = "\n".join(
        [
            "# HELP vllm:spec_decode_num_drafts_total drafts",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0',
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 21.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9.0',
        ]
    )
    assert parse_counters(page) == {"drafts": 15.0, "accepted_tokens": 21.0}
    assert parse_counters("") == {"drafts": 0.0, "accepted_tokens": 0.0}


def test_a_level_reports_ttft_tpot_rate_and_tau() -> None:
    requests = [
        {"ttft": 0.1, "tpot": 0.01, "tokens": 11},
        {"ttft": 0.3, "tpot": 0.03, "tokens": 9},
        {"ttft": 0.2, "tokens": 1},
    ]
    row = level_summary(requests, 2.0, {"drafts": 5, "accepted_tokens": 4}, {"drafts": 15, "accepted_tokens": 24})
    assert row["requests"] == 3 and row["output_tokens"] == 21 and row["tokens_per_s"] == 10.5
    assert (
        round(row["ttft_ms"]["mean"], 6) == 200 and round(row["tpot_ms"]["mean"], 6) == 20
    )  # one-token reply: no TPOT
    assert row["drafts"] == 10 and row["tau"] == 3.0
    assert (
        level_summary(requests, 1.0, {"drafts": 0, "accepted_tokens": 0}, {"drafts": 0, "accepted_tokens": 0})["tau"]
        is None
    )


def _row(drafter: str, concurrency: int, tpot: float, rate: float, tau: float | None) -> dict:
    return {"drafter": drafter, "concurrency": concurrency, "tpot_ms": {"mean": tpot}, "tokens_per_s": rate, "tau": tau}


def test_the_table_gives_the_speedup_per_level_and_the_plot_draws(tmp_path: Path) -> None:
    rows = [_row("trained", 1, 5.0, 200, 2.8), _row("trained", 4, 8.0, 500, 2.8)]
    rows += [_row("no", 1, 10.0, 100, None), _row("no", 4, 12.0, 400, None)]
    table = latency_table(rows)
    assert table["rows"] == rows
    assert table["speedup"] == [
        {"concurrency": 1, "tpot": 2.0, "tokens_per_s": 2.0, "tau": 2.8},
        {"concurrency": 4, "tpot": 1.5, "tokens_per_s": 1.25, "tau": 2.8},
    ]
    assert latency_table([]) is None
    plot_latency(rows, tmp_path / "latency.png")
    image = Image.open(tmp_path / "latency.png")
    assert image.format == "PNG" and image.size == (1210, 440)
