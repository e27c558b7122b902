"""The torch backend under the launchers users start it with: torchrun on one host and as
two nodes, gradsync-run, and torchrun --max_restarts after a rank is killed with kill -9,
where examples/torch/train.py resumes from its checkpoint and ends as an uninterrupted run."""
import json
import os
import pathlib
import subprocess
import sys

import ranks

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("GRADSYNC_BUILD_DIR", ROOT / "build")).resolve()
TRAIN = ROOT / "examples" / "torch" / "train.py"
SMALL = ["--backend", "gradsync", "--model", "mlp", "--width", "64", "--depth", "2",
         "--train-limit", "512", "--test-limit", "200", "--no-progress", "--batch", "32"]


def torchrun(args, log_dir, extra_env=None, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1",
           "--log_dir", str(log_dir)] + args
    env = dict(os.environ, **(extra_env or {}))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


# Also the example's codec hook with step-ahead error feedback (--step-ahead).
def test_torchrun_one_host(tmp_path):
    out = tmp_path / "r.json"
    done = torchrun(["--standalone", "--nproc_per_node", "2", str(TRAIN), *SMALL,
                     "--hook", "topk:ratio=0.1", "--step-ahead", "--json", str(out)],
                    tmp_path / "logs")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(out.read_text())["test_accuracy"] > 0


def test_torchrun_as_two_nodes(tmp_path):
    port = ranks.free_port()
    common = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
              "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "gradsync-test"]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--redirects", "1",
                               "--tee", "1", "--log_dir", str(tmp_path / f"logs{n}"), *common,
                               str(TRAIN), *SMALL],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-3000:]
    assert any("final: test accuracy" in text for text in outputs)


def test_gradsync_run_starts_a_torch_script(tmp_path):
    done = subprocess.run([str(BUILD / "tools" / "gradsync-run"), "-n", "3", "--",
                           sys.executable, str(TRAIN), *SMALL], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "final: test accuracy" in done.stdout + done.stderr


def test_a_rank_killed_restarts_and_resumes_to_the_uninterrupted_result(tmp_path):
    plain = tmp_path / "plain.json"
    done = torchrun(["--standalone", "--nproc_per_node", "2", str(TRAIN), *SMALL,
                     "--epochs", "3", "--json", str(plain)], tmp_path / "logs0")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    resumed = tmp_path / "resumed.json"
    done = torchrun(["--standalone", "--nproc_per_node", "2", "--max_restarts", "1", str(TRAIN),
                     *SMALL, "--epochs", "3", "--json", str(resumed),
                     "--checkpoint", str(tmp_path / "ckpt"), "--resume",
                     "--fail-once-after-epoch", "1"], tmp_path / "logs1")
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-4000:]
    assert "killing itself" in text
    # The surviving rank raised, naming the lost one, so torchrun could restart the job.
    assert "rank 1" in text and ("peer lost" in text or "aborted" in text), text[-4000:]
    a, b = json.loads(plain.read_text()), json.loads(resumed.read_text())
    assert a["test_loss"] == b["test_loss"] and a["test_accuracy"] == b["test_accuracy"]
