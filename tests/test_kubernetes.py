"""examples/kubernetes/: every manifest is valid against Kubernetes 1.30's schemas
(offline, strict), every gradsync command line in it passes the real argument
parsers, and train-job.yaml's pods run here as they would start: the key copy,
the sidecar daemon until its readiness probe passes, then the trainer, with the
manifest's own command lines and environment (pod DNS names mapped to ports
on 127.0.0.1, the volumes to folders)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import free_ports

from conftest import poll_until

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "examples" / "kubernetes"
K8S_VERSION = "1.30.0"  # the oldest still supported with native sidecars on by default
yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")


def documents() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted(FOLDER.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            yield path.name, document


def pod_specs(document: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if document["kind"] == "PyTorchJob":
        for replica in document["spec"]["pytorchReplicaSpecs"].values():
            yield replica["template"]["spec"]
    elif "template" in document.get("spec", {}):
        yield document["spec"]["template"]["spec"]


def command_lines(spec: dict[str, Any]) -> Iterator[list[str]]:
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        yield [*container.get("command", []), *container.get("args", [])]
        probe = container.get("readinessProbe", {}).get("exec")
        if probe:
            yield list(probe["command"])


@pytest.mark.timeout(60)
def test_manifests_match_the_schemas() -> None:
    kinds = []
    for name, document in documents():
        kinds.append(document["kind"])
        if document["kind"] == "PyTorchJob":  # a CRD: check its pod templates as such
            for role, replica in document["spec"]["pytorchReplicaSpecs"].items():
                kubernetes_validate.validate({
                    "apiVersion": "v1", "kind": "PodTemplate",
                    "metadata": {"name": f"{name}-{role.lower()}"},
                    "template": replica["template"]}, K8S_VERSION, strict=True)
        else:
            kubernetes_validate.validate(document, K8S_VERSION, strict=True)
    assert sorted(kinds) == ["DaemonSet", "Job", "PyTorchJob", "Service"]
    broken = next(d for _, d in documents() if d["kind"] == "Job")
    broken["spec"]["template"]["spec"]["containers"][0]["sharedMemory"] = "2Gi"
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


@pytest.mark.timeout(60)
def test_command_lines_parse() -> None:
    from gradsync.client.cli.main import build_parser as cli_parser
    from gradsync.daemon.main import build_parser as daemon_parser

    checked = 0
    for _, document in documents():
        for spec in pod_specs(document):
            assert spec["initContainers" if document["kind"] != "DaemonSet" else "containers"]
            for line in command_lines(spec):
                words = [re.sub(r"\$\((\w+)\)", "0", word) for word in line]
                if words[0] == "gradsyncd":
                    daemon_parser().parse_args(words[1:])
                elif words[0] == "gradsync":
                    _, unknown = cli_parser().parse_known_args(words[1:])
                    assert unknown == [], line
                else:
                    continue
                checked += 1
    assert checked >= 9


def _local(word: str, mapping: dict[str, str]) -> str:
    for old, new in mapping.items():
        word = word.replace(old, new)
    return word


@pytest.mark.timeout(240)
def test_train_job_pods_run_here(short_tmp: str) -> None:
    pytest.importorskip("torch")
    job = next(d for name, d in documents() if name == "train-job.yaml" and d["kind"] == "Job")
    spec = job["spec"]["template"]["spec"]
    pods = job["spec"]["completions"]
    copy, sidecar = spec["initContainers"]
    trainer = spec["containers"][0]
    assert sidecar["restartPolicy"] == "Always"
    ports = free_ports(2 * pods + 1)
    peer_ports, data_ports, master = ports[:pods], ports[pods:2 * pods], ports[-1]
    base = Path(short_tmp)
    keys = base / "keys"
    for index in range(pods):  # make-keys.sh's keygen lines, with local endpoints
        subprocess.run([sys.executable, "-m", "gradsync.client.cli", "keygen", str(keys),
                        "--name", f"train-{index}", "--endpoint",
                        f"tcp://127.0.0.1:{peer_ports[index]}"], check=True,
                       capture_output=True, timeout=60)
    mappings = []
    for index in range(pods):
        pod = base / f"pod{index}"
        # In this order: the index first, then the peers' names, then the master's.
        mapping = {"$(JOB_COMPLETION_INDEX)": str(index)}
        mapping |= {f"train-{i}.train:29400": f"127.0.0.1:{peer_ports[i]}" for i in range(pods)}
        mapping |= {"train-0.train": "127.0.0.1", "29500": str(master), "29401":
                    str(data_ports[index]), "/run/gradsync": str(pod / "run"),
                    "/etc/gradsync/keys": str(keys),
                    "/etc/gradsync/authorized": str(pod / "authorized")}
        mappings.append(mapping)
    daemons: list[tuple[subprocess.Popen[bytes], Path]] = []
    trainers: list[subprocess.Popen[str]] = []
    try:
        for index, mapping in enumerate(mappings):  # each pod's init containers
            pod = base / f"pod{index}"
            (pod / "run").mkdir(parents=True, mode=0o700)
            (pod / "authorized").mkdir()
            run = [_local(w, mapping) for w in [*copy["command"], *copy.get("args", [])]]
            subprocess.run(run, check=True, timeout=30)
            line = [_local(w, mapping) for w in [*sidecar["command"], *sidecar["args"]]]
            with open(pod / "gradsyncd.log", "wb") as log:
                daemons.append((subprocess.Popen(
                    [sys.executable, "-m", "gradsync.daemon.main", *line[1:]], stdout=log,
                    stderr=subprocess.STDOUT), pod / "gradsyncd.log"))
        for index, mapping in enumerate(mappings):  # ready, then each pod's trainer
            probe = [_local(w, mapping) for w in sidecar["readinessProbe"]["exec"]["command"]]
            probe = [sys.executable, "-m", "gradsync.client.cli", *probe[1:]]

            def ready(probe: list[str] = probe) -> bool:
                return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0

            try:
                poll_until(ready, 30, f"pod {index}'s readiness probe passes")
            except AssertionError as exc:
                raise AssertionError(f"{exc}:\n{daemons[index][1].read_text()}") from None
            env = {**os.environ, **{e["name"]: _local(e.get("value", str(index)), mapping)
                                    for e in trainer["env"]}}
            words = [_local(w, mapping) for w in [*trainer["command"], *trainer["args"]]]
            trainers.append(subprocess.Popen(
                [sys.executable, "-m", "gradsync.client.cli", *words[1:]], cwd=ROOT, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [t.communicate(timeout=180)[0] for t in trainers]
        for t, out in zip(trainers, outputs, strict=True):
            assert t.returncode == 0, out
        assert "OK: parameters identical on all 2 ranks" in outputs[0], outputs[0]
    finally:
        for process in trainers:
            if process.poll() is None:
                process.kill()
        for process, _ in daemons:  # the kubelet stops the sidecars with SIGTERM
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    for process, log_path in daemons:
        assert process.wait(max(1.0, deadline - time.monotonic())) == 0, log_path.read_text()
        assert " WARNING " not in log_path.read_text(), log_path.read_text()
