import json
import re
import textwrap

import pytest

import ab_libraries

# A benchmark that writes PREFIX.json the way bench_kernels.py does, its times scaled by the number in the
# library file, and appends the library it ran under to a log.
FAKE_BENCH = textwrap.dedent("""
    import json, os, sys
    prefix = sys.argv[sys.argv.index("--out") + 1]
    lib = os.environ["HF_KBIT_LIBRARY"]
    scale = float(open(lib).read())
    with open(os.environ["AB_TEST_LOG"], "a") as f:
        f.write(os.path.basename(lib) + "\\n")
    if scale < 0:
        sys.exit("the kernel failed")
    rows = [{"shape": "q/o", "M": m, "bits": 4, "bf16_us": 20.0, "us": 10.0 * m * scale, "cost_pct": 1.5}
            for m in (1, 16)]
    json.dump({"meta": {}, "results": rows}, open(prefix + ".json", "w"))
""")


@pytest.fixture
def bench(tmp_path, monkeypatch):
    script = tmp_path / "fake_bench.py"
    script.write_text(FAKE_BENCH)
    monkeypatch.setenv("AB_TEST_LOG", str(tmp_path / "runs.log"))
    return script


def library(tmp_path, name, scale):
    path = tmp_path / name
    path.write_text(str(scale))
    return path


def test_run_order_reverses_every_other_round():
    assert ab_libraries.run_order(["a", "b"], 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]


def test_pair_takes_each_librarys_least_time_and_the_baselines_spread():
    def rows(us):
        return [{"shape": "q/o", "M": 1, "us": us, "bf16_us": 20.0, "cost_pct": 3.0}]

    paired = ab_libraries.pair({"base": [rows(10.0), rows(10.5)], "new": [rows(9.2), rows(9.0)]})
    by_field = {e["field"]: e for e in paired}
    assert set(by_field) == {"us", "bf16_us"}  # cost_pct is a float but not a time
    e = by_field["us"]
    assert e["cell"] == {"shape": "q/o", "M": 1}
    assert e["us"] == {"base": 10.0, "new": 9.0}
    assert e["change_pct"]["new"] == pytest.approx(-10.0)
    assert e["spread_pct"] == pytest.approx(5.0)


def test_pair_refuses_runs_of_different_cells():
    a = [{"shape": "q/o", "M": 1, "us": 1.0}]
    b = [{"shape": "q/o", "M": 2, "us": 1.0}]
    with pytest.raises(ValueError, match="new, round 1: its cells differ"):
        ab_libraries.pair({"base": [a], "new": [b]})


def test_main_alternates_the_libraries_and_writes_the_paired_table(tmp_path, bench, capsys):
    base, slow = library(tmp_path, "base.so", 1.0), library(tmp_path, "slow.so", 1.1)
    out = tmp_path / "ab"
    assert ab_libraries.main(["--lib", f"base={base}", "--lib", f"slow={slow}", "--rounds", "2", "--out", str(out),
                              "--", str(bench), "--shapes", "8b gate/up", "--ms", "1", "16"]) == 0
    assert (tmp_path / "runs.log").read_text().split() == ["base.so", "slow.so", "slow.so", "base.so"]
    result = json.loads(out.with_suffix(".json").read_text())
    us = [e for e in result["cells"] if e["field"] == "us"]
    assert [e["cell"]["M"] for e in us] == [1, 16]
    assert all(e["change_pct"]["slow"] == pytest.approx(10.0) for e in us)
    assert all(e["spread_pct"] == pytest.approx(0.0) for e in us)
    # The record names the libraries as given and leaves the output prefix out of the command.
    assert result["meta"]["libraries"] == {"base": str(base), "slow": str(slow)}
    # ... quoted as a shell reads it (an argument with a space stays one).
    assert "--out" not in result["meta"]["command"]
    assert result["meta"]["command"].endswith("--shapes '8b gate/up' --ms 1 16")
    md = out.with_suffix(".md").read_text()
    assert "| shape q/o, M 16, bits 4 | us | 160.00 | 176.00 | +10.0% | 0.0% |" in md
    assert md in capsys.readouterr().out


def test_main_stops_at_a_failed_run_naming_its_round_and_library(tmp_path, bench):
    base, broken = library(tmp_path, "base.so", 1.0), library(tmp_path, "broken.so", -1)
    with pytest.raises(SystemExit, match=r"round 1, broken: the benchmark exited 1:\n.*the kernel failed"):
        ab_libraries.main(["--lib", f"base={base}", "--lib", f"broken={broken}", "--", str(bench)])


@pytest.mark.parametrize("args, pattern", [
    (["--lib", "a"], r"--lib: expected NAME=PATH, got 'a'"),
    (["--lib", "a={lib}"], r"expected two or more distinct names, got \['a'\]"),
    (["--lib", "a={lib}", "--lib", "a={lib}"], r"two or more distinct names, got \['a', 'a'\]"),
    (["--lib", "a={lib}", "--lib", "b={tmp}/missing.so"], r"--lib: no such library: b=\S*missing.so"),
    (["--lib", "a={lib}", "--lib", "b={lib}", "--rounds", "0"], r"--rounds: expected >= 1, got 0"),
    (["--lib", "a={lib}", "--build", "b={tmp}"], r"--build b=\S+: expected a source tree"),
    (["--lib", "a={lib}", "--build", "b={root}/build/ab/b"], r"--build b=\S+: that is where its library is built"),
])
def test_main_refuses_bad_arguments(tmp_path, bench, capsys, monkeypatch, args, pattern):
    lib = library(tmp_path, "a.so", 1.0)
    if any("{root}" in a for a in args):  # a source tree where the script builds: shaped like one
        monkeypatch.setattr(ab_libraries, "BUILD_DIR", tmp_path / "build" / "ab")
        fake_tree(tmp_path / "build" / "ab" / "b", "")
    args = [a.format(lib=lib, tmp=tmp_path, root=tmp_path) for a in args]
    with pytest.raises((SystemExit, ValueError)) as err:
        ab_libraries.main([*args, "--", str(bench)])
    text = capsys.readouterr().err + str(err.value)  # argparse's message, or the exception's
    assert re.search(pattern, text), text


def test_main_refuses_a_benchmark_output_prefix_and_a_missing_benchmark(tmp_path, bench, capsys):
    lib = library(tmp_path, "a.so", 1.0)
    libs = ["--lib", f"a={lib}", "--lib", f"b={lib}"]
    with pytest.raises(SystemExit):
        ab_libraries.main([*libs, "--", str(bench), "--out", "x"])
    assert "the benchmark's --out is this script's to set" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab_libraries.main(libs)
    assert "after --: a benchmark script" in capsys.readouterr().err


def fake_tree(root, source):
    """A source tree shaped like the project's (CMakeLists.txt, csrc/ building libhf_kbit_cuda), in plain C."""
    (root / "csrc").mkdir(parents=True)
    (root / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.18)\nproject(fake C)\n"
                                         "add_subdirectory(csrc)\n")
    (root / "csrc" / "CMakeLists.txt").write_text("add_library(hf_kbit_cuda SHARED lib.c)\n")
    (root / "csrc" / "lib.c").write_text(source)
    return root


def test_build_libraries_builds_each_tree_and_reports_a_failed_build(tmp_path):
    good = fake_tree(tmp_path / "good", "int kbit_version(void) { return 1; }\n")
    libs = ab_libraries.build_libraries([("good", good)], arch="90a", jobs=2, into=tmp_path / "ab")
    assert libs == {"good": tmp_path / "ab" / "good" / "csrc" / "libhf_kbit_cuda.so"} and libs["good"].is_file()
    bad = fake_tree(tmp_path / "bad", "this is not C\n")
    with pytest.raises(RuntimeError, match=r"--build bad: the build failed \(exit \d+\); the end of .*build.log"):
        ab_libraries.build_libraries([("bad", bad)], arch="90a", jobs=2, into=tmp_path / "ab")
