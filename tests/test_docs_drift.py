"""The docs against what this tree does: every CLI option is documented, every relative link resolves, and the
output lines and figures the pages quote are what the commands print (read from the page and recomputed, so a
change that moves one fails here until the page is updated)."""
import argparse
import glob
import importlib
import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBCOMMANDS = ("estimate", "gpus", "validate", "plan", "check", "report", "calibrate")


def _pages(*patterns: str) -> list[str]:
    return [p for pat in patterns for p in sorted(glob.glob(os.path.join(ROOT, pat), recursive=True))]


def _read(path: str) -> str:
    return open(path, encoding="utf-8").read()


def _folded(*parts: str) -> str:
    """A page with its line breaks folded to spaces (prose wraps wherever it likes)."""
    return " ".join(_read(os.path.join(ROOT, *parts)).split())


def _parser(name: str) -> argparse.ArgumentParser:
    # estimate and gpus are parsed by the top-level parser; the others by their own module's (cli/<name>.py)
    if name in ("estimate", "gpus"):
        from megatron_memguard.cli.main import build_parser
        sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
        return sub.choices[name]
    return importlib.import_module(f"megatron_memguard.cli.{name}").build_parser()


def test_every_cli_option_is_named_in_the_docs():
    text = "\n".join(_read(p) for p in _pages("README.md", "docs/**/*.md"))
    missing = []
    for name in SUBCOMMANDS:
        for action in _parser(name)._actions:
            strings = [s for s in action.option_strings if s not in ("-h", "--help")]
            if strings and not any(re.search(re.escape(s) + r"(?![\w-])", text) for s in strings):
                missing.append(f"memguard {name} {'/'.join(strings)}")
    assert missing == []


def _anchors(path: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-', repeats numbered."""
    out, seen, fence = set(), {}, False
    for line in _read(path).splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_relative_link_of_the_docs_resolves():
    bad, count = [], 0
    for page in _pages("README.md", "docs/**/*.md", "benchmarks/**/*.md", "examples/**/*.md"):
        text = re.sub(r"^```.*?^```", "", _read(page), flags=re.M | re.S)
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):          # http:, https:, mailto:
                continue
            count += 1
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
            where = f"{os.path.relpath(page, ROOT)}: {target}"
            if not os.path.exists(dest):
                bad.append(where + " (no such file)")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                bad.append(where + " (no such heading)")
    assert count > 200 and bad == []


def test_reports_result_lines_are_what_memguard_report_prints(tmp_path, capsys):
    # docs/reports.md "Terminal": the result lines of tests/test_report_runlog.py's runs (8 ranks in PP4 with rank
    # 3 at 1.08 x its prediction; 4 ranks at 0.97 x), which write the JSONL files through the real MemoryMonitor
    from megatron_memguard.cli.main import main
    from runlog_util import make_estimate, write_run
    page = _read(os.path.join(ROOT, "docs", "reports.md"))
    quoted = re.findall(r"^result: .*$", page, flags=re.M)
    assert [q.split()[1] for q in quoted] == ["OK", "OVER"]
    est = make_estimate(pp=4, world=16)
    write_run(tmp_path / "over", est, ranks_per_stage=2, iterations=5, scales={3: 1.08})
    write_run(tmp_path / "ok", est, ranks_per_stage=1, iterations=3)
    for run, line, code in (("ok", quoted[0], 0), ("over", quoted[1], 1)):
        assert main(["report", str(tmp_path / run)]) == code
        assert line in capsys.readouterr().out.splitlines(), line


def test_hook_recompute_ladder_example_is_what_the_estimate_says():
    # docs/hook.md "The recompute ladder": Bridge's DeepSeek-V3 recipe on its 1,024 H100s, tight without
    # recomputation, fits with the two element-wise modules (tests/test_recompute_ladder.py finds that rung)
    from megatron_memguard import estimate, lookup_gpu, resolve
    from megatron_memguard.readers.models import read_model
    m = re.search(r"DeepSeek-V3 recipe on its 1,024 H100s \(with `model\.moe_flex_dispatcher_backend=deepep`: [^)]*\), "
                  r"tight at (\d+)% without recomputation, fits at (\d+)% with `layernorm` and `moe_act` "
                  r"\(`model\.recompute_granularity=selective, model\.recompute_modules=\[layernorm,moe_act\]` from "
                  r"`memguard check`\)", _folded("docs", "hook.md"))
    assert m, "docs/hook.md no longer states the DeepSeek-V3 example"
    raw = read_model("deepseek_v3").with_args(moe_flex_dispatcher_backend="deepep")
    h100 = lookup_gpu("H100-80GB")
    for want, verdict, extra in ((m.group(1), "tight", {}),
                                 (m.group(2), "fits", dict(recompute_granularity="selective",
                                                           recompute_modules=["layernorm", "moe_act"]))):
        est = estimate(resolve(raw.with_args(**extra), world_size=1024), gpu=h100)
        assert (f"{est.peak_device_bytes / est.gpu_memory_bytes:.0%}", est.verdict) == (f"{want}%", verdict)


def test_planner_pages_search_counts_are_what_the_plan_prints(capsys):
    # docs/planner.md section 4 "Speed": the search counts of the page's first command (Llama-3.1-70B on 1024 H100s),
    # with the default 4% tie window, a 3% one and none, as its "search:" line prints them
    from megatron_memguard.cli.main import main
    text = _folded("docs", "planner.md")
    m = re.search(r"1024 H100s: ([\d,]+) layouts considered, ([\d,]+) visited, ([\d,]+) bounded out, (\d+) estimated, "
                  r"(\d+) fitting .*?: (\d+) estimated with a 3% window, (\d+) without one\)", text)
    assert m, "docs/planner.md no longer states the plan's search counts"
    considered, visited, bounded, estimated, fitting, at3, at0 = m.groups()
    command = next(line.strip() for line in _read(os.path.join(ROOT, "docs", "planner.md")).splitlines()
                   if line.startswith("memguard plan ") and "llama3.1-70b" in line)
    searched = {}
    for window in ("0.04", "0.03", "0"):
        words = shlex.split(command)[1:]
        assert main(words[:words.index("--")] + ["--tie-window", window] + words[words.index("--"):]) == 0
        searched[window] = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("search: "))
    assert searched["0.04"].startswith(f"search: {considered} layouts, {visited} visited fastest first"), searched
    assert f": {bounded} cannot fit" in searched["0.04"] and f", {estimated} estimated, {fitting} fit " in searched["0.04"]
    assert f", {at3} estimated, " in searched["0.03"] and f", {at0} estimated, " in searched["0"], searched


def test_readme_moe_referee_figures_are_the_stored_grids():
    # README "How accurate it is": the CPU referee's MoE grid as tests/test_referee_moe_stored.py scores it (its
    # configurations, the largest whole-rank peak error) and as tests/test_moe_estimator.py checks it layer by layer
    # (every configuration but those recomputing the MoE block or overlapping its all-to-all)
    from benchmarks.referee.grids.dense import resolve_config
    from megatron_memguard import estimate
    from test_referee_moe_stored import _configs
    m = re.search(r"On the CPU referee, (\d+) MoE configurations: every MoE layer byte-exact at the peak \(in the (\d+) "
                  r"that neither recompute the MoE block nor overlap its all-to-all\), peak within ([\d.]+)%",
                  _folded("README.md"))
    assert m, "README no longer states the MoE referee's figures"
    configs = _configs()
    worst = 0.0
    for cfg, measured in configs:
        L, _ = resolve_config(cfg["flags"], cfg["world_size"])
        for r in measured["ranks"]:
            st = estimate(L, profile="local", device="cpu",
                          dp_rank=r["dp_rank"] if L.use_distributed_optimizer else "max").stages[r["pp_rank"]]
            worst = max(worst, abs(st.peak_allocated_bytes / r["peak_bytes"] - 1))
    layered = [c for c, measured in configs if "moe" not in (measured["settings"].get("recompute_modules") or [])
               and not measured["settings"].get("overlap_moe_expert_parallel_comm")]
    assert (m.group(1), m.group(2), m.group(3)) == (str(len(configs)), str(len(layered)), f"{worst:.2%}"[:-1])


def test_calibration_pages_muon_table_is_what_the_benchmark_prints():
    # docs/calibration.md "The Muon records": each row's activation bytes (measured, memguard's; MiB) and peak
    # error are benchmarks/muon_peak_evidence.py's for the record (Megatron's CI, shared/groundtruth)
    from benchmarks.muon_peak_evidence import MiB, rows
    page = _read(os.path.join(ROOT, "docs", "calibration.md"))
    table = re.findall(r"^\| `\.\.\._(\w+)` \| (H100|GB200) \| (\d+) \| [^|]+ \| (\d+) \| (\d+) \| ([-+][\d.]+%) \|$",
                       page, flags=re.M)
    got = {(r["id"].split("/")[1].replace("gpt3_moe_mcore_te_ep8_resume_torch_dist_", ""),
            r["platform"].replace("dgx_", "").upper()): r for r in rows()}
    assert len(table) == len(got) == 5
    for name, platform, ep, act, act_est, err in table:
        r = got[(name, platform)]
        assert (ep, act, act_est, err) == (str(r["ep"]), f"{r['act_measured'] / MiB:.0f}", f"{r['act_est'] / MiB:.0f}",
                                           f"{(r['est_peak'] - r['peak']) / r['peak']:+.1%}"), (name, platform)


def test_attention_auto_a100_figures_are_the_ci_records():
    # docs/terms/layer_activations.md: the clean A100 records of Megatron's CI (shared/groundtruth) that run
    # --attention-backend auto (Transformer Engine, flash-attn 2 on sm80) without CP, scored as
    # benchmarks/accuracy_megatron_ci.py scores them (estimated / measured peak - 1)
    import statistics
    from benchmarks.accuracy_megatron_ci import evaluate, load_records
    m = re.search(r"On the (\d+) clean A100 records of Megatron's CI that run `auto` without CP .*? they are at "
                  r"([-+][\d.]+)% \(mean \|error\| ([\d.]+)%\) today", _folded("docs", "terms", "layer_activations.md"))
    assert m, "docs/terms/layer_activations.md no longer states the A100 figures"
    rows = [row for row in map(evaluate, load_records()) if row.platform == "A100"]
    errs = [r.est_peak / r.measured_peak - 1 for r in rows if r.layout is not None and r.layout.context_parallel_size == 1
            and r.layout.attention_backend == "auto" and r.layout.transformer_impl == "transformer_engine"]
    assert m.groups() == (str(len(errs)), f"{statistics.mean(errs):+.2%}"[:-1],
                          f"{statistics.mean(abs(e) for e in errs):.2%}"[:-1])


def test_fsdp_pages_ci_table_is_what_the_accuracy_benchmark_gives():
    # docs/terms/fsdp.md "Checked against": Megatron's CI records of MoE under Megatron-FSDP, peak and after-step
    # errors as benchmarks/accuracy_megatron_ci.py --records moe scores them (estimated / measured - 1)
    from benchmarks.accuracy_megatron_ci import evaluate, load_records
    from benchmarks.shared_data import MOE_RECORDS
    page = _read(os.path.join(ROOT, "docs", "terms", "fsdp.md"))
    table = re.findall(r"^\| (`[^`]+`|same), (H100|GB200)[^|]* \| ([-+][\d.]+) % \| ([-+][\d.]+) % \|$", page, flags=re.M)
    assert len(table) == 3
    rows = {(row.id.split("/")[1], row.platform): row for row in map(evaluate, load_records(MOE_RECORDS))}
    name = None
    for cell, platform, peak, after in table:
        name = name if cell == "same" else cell.strip("`")
        pattern = re.escape(name).replace(r"\.\.\.", ".*")
        row = next(r for (n, p), r in rows.items() if p == platform and re.fullmatch(pattern, n))
        assert (peak, after) == (f"{row.est_peak / row.measured_peak - 1:+.1%}"[:-1],
                                 f"{row.est_steady / row.measured_steady - 1:+.1%}"[:-1]), (name, platform)


def test_fp8_pages_ci_table_is_what_the_accuracy_benchmark_gives():
    # docs/terms/fp8.md "Against Megatron's CI": the FP8 records' first runs (flagged ones too, as
    # `accuracy_megatron_ci.py --records moe --all` scores them), peak and after-step errors per GPU
    from benchmarks.accuracy_megatron_ci import evaluate, load_records
    from benchmarks.shared_data import MOE_RECORDS
    section = _read(os.path.join(ROOT, "docs", "terms", "fp8.md")).split("## Against Megatron's CI")[1]
    table = re.findall(r"^\| ([\w]+)( \(H100 / GB200\))?[^|]* \| [^|]*?(H100|GB200)? \| ([-+\d.% /]+) \| ([-+\d.% /]+) \|$",
                       section, flags=re.M)
    assert len(table) == 4
    rows = {(row.id.split("/")[1], row.platform): row for r in load_records(MOE_RECORDS, include_flagged=True)
            if not r.get("is_second_run") for row in [evaluate(r)]}
    for name, both, gpu, peaks, afters in table:
        gpus = ["H100", "GB200"] if both else [gpu]
        for platform, peak, after in zip(gpus, peaks.split(" / "), afters.split(" / ")):
            row = rows[(name, platform)]
            assert (peak, after) == (f"{row.est_peak / row.measured_peak - 1:+.1%}",
                                     f"{row.est_steady / row.measured_steady - 1:+.1%}"), (name, platform)


def test_hook_pages_e2e_prediction_is_the_estimate():
    # docs/hook.md "Hook points per era": the PP2 CPU run of tests/test_hook_runtime_cpu.py through megatron-core
    # 0.17.1's own pretrain(); the predicted peaks are memguard's for that run's flags (the measured ones are the
    # run's, which needs 0.17.1's megatron.training: tests/run_releases.sh)
    from megatron_memguard import estimate, layout_from_flags
    from test_hook_runtime_cpu import MODEL
    m = re.search(r"max allocated [\d.]+ / [\d.]+ MiB against predicted ([\d.]+) / ([\d.]+) MiB", _folded("docs", "hook.md"))
    assert m, "docs/hook.md no longer states the end-to-end run's prediction"
    layout = layout_from_flags(MODEL + ["--pipeline-model-parallel-size", "2"], world_size=2, megatron_version="0.17.1")
    est = estimate(layout, device="cpu", gpu_memory=80 * 2**30, dp_rank=0)
    assert m.groups() == tuple(f"{s.peak_allocated_bytes / 2**20:.1f}" for s in est.stages)
