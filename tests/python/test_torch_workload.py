"""A PyTorch model as the advisor's workload (gradsync.torch.save_workload), read back by
gradsync-advise --layers."""
import json
import os
import subprocess

import torch

import gradsync.torch

BUILD = os.environ.get("GRADSYNC_BUILD_DIR", "")


class Net(torch.nn.Module):
    """A convolution, a normalisation and two linear layers, with parameter-free modules
    between them, and one frozen layer."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.fc1 = torch.nn.Linear(8 * 16 * 16, 256)
        self.fc2 = torch.nn.Linear(256, 10, bias=False)

    def forward(self, x):
        x = torch.relu(self.norm(self.conv(x)))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def test_layers_in_forward_order_with_their_tensors_flops_and_times():
    torch.manual_seed(0)
    net = Net()
    w = gradsync.torch.workload(net, torch.randn(4, 3, 16, 16), optimizer="adam", repeats=2)
    assert w["batch"] == 4 and w["optimizer"] == "adam" and w["name"] == "Net"
    assert [l["name"] for l in w["layers"]] == ["conv", "norm", "fc1", "fc2"]  # not the frozen one
    counts = [sorted(t["count"] for t in l["tensors"]) for l in w["layers"]]
    assert counts == [[8, 8 * 3 * 9], [8, 8], [256, 256 * 2048], [2560]]
    rows = {l["name"]: [t["rows"] for t in l["tensors"] if t["rows"]] for l in w["layers"]}
    assert rows == {"conv": [8], "norm": [], "fc1": [256], "fc2": [10]}  # vectors: 0
    by_name = {l["name"]: l for l in w["layers"]}
    # A multiply-add is two FLOPs: per sample, each output element of fc1 takes 2048 of them,
    # each of the convolution's 3 x 3 x 3.
    assert by_name["fc1"]["forward_flops"] == 2 * 2048 * 256
    assert by_name["conv"]["forward_flops"] == 2 * 27 * 8 * 16 * 16
    for layer in w["layers"]:
        assert layer["backward_flops"] == 2 * layer["forward_flops"]
        assert layer["forward_ms"] > 0 and layer["backward_ms"] > 0, layer
    untimed = gradsync.torch.workload(net, torch.randn(4, 3, 16, 16), timed=False, repeats=1)
    assert all("forward_ms" not in l for l in untimed["layers"])
    # The model's gradients are left as they were found: none.
    assert all(p.grad is None for p in net.parameters())


def test_gradsync_advise_reads_the_saved_workload(tmp_path):
    path = tmp_path / "net.json"
    w = gradsync.torch.save_workload(str(path), Net(), torch.randn(8, 3, 16, 16), repeats=1)
    assert json.loads(path.read_text()) == w
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"name": "test", "cores_per_host": 8,
                                   "intra": {"alpha_us": 5, "bandwidth_gbps": 5}}))
    out = subprocess.run([os.path.join(BUILD, "tools", "gradsync-advise"), "--layers",
                          str(path), "--profile", str(profile), "--ranks", "2", "--json",
                          str(tmp_path / "advice.json")],
                         capture_output=True, text=True, check=True).stdout
    params = sum(p.numel() for p in Net().parameters() if p.requires_grad)
    assert f"Net, {params} parameters, batch 8" in out, out
    advice = json.loads((tmp_path / "advice.json").read_text())
    assert advice["predicted"]["compute_s"] > 0


def test_a_model_without_gradients_is_refused():
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    try:
        gradsync.torch.workload(frozen, torch.randn(2, 4))
    except ValueError as e:
        assert "no parameters that need a gradient" in str(e)
    else:
        raise AssertionError("a model without trainable parameters was accepted")
