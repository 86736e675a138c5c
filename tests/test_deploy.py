"""More than one replica: three tiny-model servers behind a real HAProxy (deploy/haproxy_cfg.py),
restarted and killed under steady load, over loopback only."""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import orjson
import pytest

from .client import post
from .conftest import ROOT, ServerProcess, free_port

sys.path.insert(0, os.path.join(ROOT, "deploy"))
import haproxy_cfg  # noqa: E402

HAPROXY = shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy", "/sbin/haproxy") if os.path.exists(p)),
                                          None)
needs_haproxy = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (make install puts it in with "
                                   "apt-get as root; install it by hand elsewhere: apt-get install -y haproxy)")

REPLICA_ARGS = ["--served-model-name", "tiny", "--concurrent-execute-stream-num", "1", "--torch-threads", "1",
                "--max-seqs-per-batch", "8", "--drain-timeout", "20", "--access-log", "off"]
PROMPTS = [[1, 504 + i, 3827, 314 + 7 * i, 2041] for i in range(8)]
MAX_TOKENS = 4
CONCURRENCY = 16
REQUEST_TIMEOUT = 60.0  # a request that takes this long has hung: it counts as a failure


class HaproxyAdmin:
    """HAProxy's runtime API over its stats socket."""

    def __init__(self, path: str) -> None:
        self.path = path

    def command(self, text: str) -> str:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(self.path)
            sock.sendall(text.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def statuses(self) -> dict[str, str]:
        """Replica name -> UP, DOWN, ... (the status column of `show stat`)."""
        lines = self.command("show stat").splitlines()
        header = lines[0].lstrip("# ").split(",")
        name, status, proxy = header.index("svname"), header.index("status"), header.index("pxname")
        return {row[name]: row[status] for row in (line.split(",") for line in lines[1:] if line)
                if row[proxy] == "replicas" and row[name].startswith("r")}

    def wait_status(self, name: str, prefix: str, timeout: float = 60) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.statuses().get(name, "").startswith(prefix):
                return time.monotonic()
            time.sleep(0.01)
        raise AssertionError(f"haproxy never saw {name} {prefix}: {self.statuses()}")


class Fleet:
    """Three replicas on fixed ports and HAProxy in front, health-checked every 200 ms."""

    def __init__(self, model_dir: str, tmp: str, replicas: int = 3) -> None:
        self.args = ["--model", model_dir, *REPLICA_ARGS]
        self.ports = [free_port() for _ in range(replicas)]
        self.replicas: list[ServerProcess | None] = [None] * replicas
        threads = [threading.Thread(target=self.start, args=(i,)) for i in range(replicas)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.port = free_port()
        self.admin = HaproxyAdmin(os.path.join(tmp, "haproxy.sock"))
        config = haproxy_cfg.render([f"127.0.0.1:{p}" for p in self.ports], f"127.0.0.1:{self.port}",
                                    inter="200ms", fall=1, rise=1, stats_socket=self.admin.path,
                                    connect_timeout="1s", stream_timeout="60s")
        config_path = os.path.join(tmp, "haproxy.cfg")
        with open(config_path, "w") as f:
            f.write(config)
        self.log_path = os.path.join(tmp, "haproxy.log")
        self._log = open(self.log_path, "w")  # noqa: SIM115  (open for HAProxy's whole life)
        self.haproxy = subprocess.Popen([HAPROXY, "-db", "-f", config_path], stdout=self._log,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.admin.path) and time.monotonic() < deadline:
            assert self.haproxy.poll() is None, self.log()
            time.sleep(0.05)
        for i in range(replicas):
            self.admin.wait_status(f"r{i}", "UP")

    def start(self, i: int) -> None:
        self.replicas[i] = ServerProcess(self.args, port=self.ports[i])

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def log_lines(self) -> list[list[str]]:
        """HAProxy's log: [request id, backend/replica, status, termination state, retries, ms] each."""
        return [line.split() for line in self.log().splitlines() if line.count(" ") == 5 and "/" in line.split()[1]]

    def logged(self, request_ids, timeout: float = 30) -> dict[str, list[str]]:
        """HAProxy's log lines of these requests by id, once every one is written (it logs when a
        stream ends, which may be just after its client read the answer)."""
        wanted = set(request_ids)
        deadline = time.monotonic() + timeout
        while True:
            lines = {line[0]: line for line in self.log_lines() if line[0] in wanted}
            if len(lines) == len(wanted) or time.monotonic() > deadline:
                return lines
            time.sleep(0.01)

    def close(self) -> None:
        self.haproxy.terminate()
        self.haproxy.wait(10)
        self._log.close()
        for replica in self.replicas:
            if replica is not None:
                replica.stop()


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    if HAPROXY is None:
        pytest.skip("haproxy is not installed")
    fleet = Fleet(tiny_model_dir, str(tmp_path_factory.mktemp("haproxy")))
    yield fleet
    fleet.close()


@pytest.fixture(scope="module")
def expected(fleet) -> list[str]:
    """Each prompt's greedy answer, asked of one replica directly, one at a time."""
    answers = []
    for prompt in PROMPTS:
        status, body, _ = post(fleet.ports[0], "/v1/completions", request_body(prompt, False))
        assert status == 200, body
        answers.append(body["choices"][0]["text"])
    return answers


def request_body(prompt: list[int], stream: bool) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}


class Outcome:
    __slots__ = ("request_id", "stream", "reused", "status", "error", "start", "end")

    def __init__(self, request_id: str, stream: bool, reused: bool, start: float) -> None:
        self.request_id = request_id
        self.stream = stream
        self.reused = reused  # sent on a kept-alive connection to HAProxy that carried an earlier request
        self.start = start
        self.status: int | None = None
        self.error = ""  # empty: a complete, correct answer
        self.end = 0.0


class Load:
    """CONCURRENCY clients, each sending one request after another through HAProxy (streamed and
    not, alternately) and checking every answer against the expected one. Even-numbered clients
    keep their connection alive, as SDKs do; odd-numbered ones open one per request."""

    def __init__(self, port: int, expected: list[str], name: str, users: bool = False) -> None:
        self.port = port
        self.users = users  # every third client sends an X-User-Id (HAProxy's user-affinity backend)
        self.name = name  # request ids are f"{name}-{client}-{n}", unique in HAProxy's log
        self.expected = expected
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(CONCURRENCY)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(REQUEST_TIMEOUT + 5)

    def wait_answers(self, count: int, timeout: float = 60) -> None:
        """Block until `count` more requests have been answered (steady load, whatever the speed)."""
        target = len(self.outcomes) + count
        deadline = time.monotonic() + timeout
        while len(self.outcomes) < target and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.outcomes) >= target, f"load stalled: {len(self.outcomes)} answers, wanted {target}"

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error]

    def _client(self, index: int) -> None:
        conn = None
        n = 0
        while not self._stop.is_set():
            n += 1
            which = (index + n) % len(PROMPTS)
            outcome = Outcome(f"{self.name}-{index}-{n}", (index + n) % 2 == 1, conn is not None, time.monotonic())
            try:
                conn = conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT)
                headers = {"content-type": "application/json", "x-request-id": outcome.request_id,
                           "connection": "keep-alive" if index % 2 == 0 else "close"}
                if self.users and index % 3 == 0:
                    headers["x-user-id"] = f"user-{index}"
                conn.request("POST", "/v1/completions", orjson.dumps(request_body(PROMPTS[which], outcome.stream)),
                             headers)
                response = conn.getresponse()
                outcome.status = response.status
                outcome.error = self._check(response, outcome, self.expected[which])
                if response.will_close:
                    conn.close()
                    conn = None
            except Exception as exc:  # noqa: BLE001  (any failure is an outcome to count)
                outcome.error = f"{type(exc).__name__}: {exc}"
                if conn is not None:
                    conn.close()
                conn = None
            outcome.end = time.monotonic()
            self.outcomes.append(outcome)
        if conn is not None:
            conn.close()

    @staticmethod
    def _check(response: http.client.HTTPResponse, outcome: Outcome, expected: str) -> str:
        raw = response.read()
        if response.status != 200:
            return f"status {response.status}: {raw[:200]!r}"
        if response.getheader("x-request-id") != outcome.request_id:
            return f"x-request-id {response.getheader('x-request-id')!r}"
        if not outcome.stream:
            choice = orjson.loads(raw)["choices"][0]
            text, reason = choice["text"], choice["finish_reason"]
        else:
            events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
            if not events or events[-1] != b"[DONE]":
                return f"stream did not end with [DONE]: {raw[-200:]!r}"
            choices = [orjson.loads(e)["choices"][0] for e in events[:-1]]
            text = "".join(c["text"] for c in choices)
            reason = choices[-1]["finish_reason"] if choices else None
        if text != expected or reason != "length":
            return f"answer {text!r} ({reason}), expected {expected!r} (length)"
        return ""


def summary(load: Load) -> str:
    streamed = sum(o.stream for o in load.outcomes)
    return f"{len(load.outcomes)} requests ({streamed} streamed), {len(load.failures)} failed"


@needs_haproxy
def test_rolling_restart_loses_no_request(fleet, expected):
    """Users with affinity among the clients: a restarted replica's users move, none fails."""
    with Load(fleet.port, expected, "restart", users=True) as load:
        load.wait_answers(CONCURRENCY * 2)
        for i, replica in enumerate(fleet.replicas):
            replica.stop()  # SIGTERM: /health answers 503, admitted requests finish, the process exits
            assert replica.proc.returncode == 0, replica.log()
            fleet.start(i)
            fleet.admin.wait_status(f"r{i}", "UP")
            load.wait_answers(CONCURRENCY * 2)
    print(f"\nrolling restart of {len(fleet.replicas)} replicas: {summary(load)}")
    assert not load.failures, [(o.request_id, o.status, o.error) for o in load.failures[:10]]
    served = {line[1] for line in fleet.log_lines()}
    assert served >= {f"replicas/r{i}" for i in range(len(fleet.replicas))}


@needs_haproxy
def test_killed_replica_fails_only_what_it_had_accepted(fleet, expected):
    victim = 1
    with Load(fleet.port, expected, "kill") as load:
        load.wait_answers(CONCURRENCY * 2)
        killed = time.monotonic()
        fleet.replicas[victim].proc.send_signal(signal.SIGKILL)
        down = fleet.admin.wait_status(f"r{victim}", "DOWN", timeout=10)
        load.wait_answers(CONCURRENCY * 4)
    fleet.replicas[victim].proc.wait(10)
    failures = load.failures
    silent = [o for o in failures if o.status is None]
    cut = [o for o in failures if o.status == 200]
    print(f"\nSIGKILL of one replica: {summary(load)}: {len(failures) - len(silent) - len(cut)} answered 502/503, "
          f"{len(cut)} streams cut short, {len(silent)} closed without an answer on a kept-alive connection; "
          f"marked down {down - killed:.2f} s after the kill")
    log = {line[0]: line for line in fleet.log_lines()}
    for o in failures:
        assert o.start < down, (o.request_id, "sent after the replica was marked down")
        # Never a hang: the client's timeout is the only clock here (how long a failure took to
        # show depends on the machine, so no bound below it is asserted).
        assert not (o.error or "").startswith("TimeoutError"), (o.request_id, "hung", o.error)
        if o.status is None:
            # HAProxy's answer when the replica of a request dies before answering, on a kept-alive
            # connection: it closes that connection without a byte, HTTP's "retry on a new
            # connection" signal, and logs nothing (abort_keep_alive in its http_ana.c). About one
            # run in ten it did the same to a request that was first on its connection
            # (`Connection: close` clients): the same clean close, never a hang, and never after
            # the replica was marked down (checked above).
            assert "RemoteDisconnected" in o.error, (o.request_id, o.reused, o.error)
            continue
        line = log[o.request_id]
        assert line[1] == f"replicas/r{victim}", line  # the killed replica had it
        if o.status == 200:  # a stream whose first tokens were out: it ends early, and HAProxy says why
            assert o.stream and line[3].startswith("SD"), (o.request_id, o.error, line)
        else:
            assert o.status in (502, 503), (o.request_id, o.status, o.error)
    fleet.start(victim)
    fleet.admin.wait_status(f"r{victim}", "UP")


# --- Kubernetes manifests and the Grafana dashboard -------------------------------------------

K8S = os.path.join(ROOT, "deploy", "k8s")
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "xllm_async.json")
# The beam engine's metrics, on the dashboard before every server exports them: each may be missing
# only while no source file under xllm_async/ names it (once one does, the server must export it).
EXPECTED_FROM_BEAM_ENGINE = {"xllm:beam_requests_total", "xllm:beams_per_request", "xllm:items_returned_per_request"}


def not_yet_in_the_source(names: set[str]) -> set[str]:
    sources = []
    for folder, _, files in os.walk(os.path.join(ROOT, "xllm_async")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    sources.append(f.read())
    text = "\n".join(sources)
    return {n for n in names if f'"{n.removeprefix("xllm:")}"' not in text}


def manifests() -> list[tuple[str, dict]]:
    yaml = pytest.importorskip("yaml")
    found = []
    for name in sorted(os.listdir(K8S)):
        if name.endswith(".yaml"):
            with open(os.path.join(K8S, name)) as f:
                found.extend((name, doc) for doc in yaml.safe_load_all(f) if doc)
    return found


def test_kubernetes_manifests_match_the_schemas():
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (the test extra) ships the schemas; not installed")
    docs = manifests()
    assert {doc["kind"] for _, doc in docs} >= {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"}
    for _, doc in docs:
        # strict: a misspelt field fails instead of being ignored by the API server
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_kubernetes_grace_period_covers_the_drain():
    docs = {doc["kind"]: doc for _, doc in manifests()}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + float(env["XLLM_DRAIN_TIMEOUT"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The HPA's metric is the one the adapter rule makes of xllm:num_requests_waiting.
    import yaml

    adapter = yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])["rules"][0]
    assert adapter["seriesQuery"].startswith("xllm:num_requests_waiting{")
    hpa_metric = docs["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert hpa_metric == "xllm_num_requests_waiting" and adapter["name"]["as"] == "xllm_${1}"


def dashboard_metrics() -> set[str]:
    import json
    import re

    with open(DASHBOARD) as f:
        panels = json.load(f)["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    return {name for e in exprs for name in re.findall(r"xllm:[A-Za-z0-9_:]+", e)}


def test_dashboard_queries_only_exported_metrics(server):
    from .client import get

    status, body, _ = get(server.port, "/metrics")
    assert status == 200
    # What the server declares (`# TYPE name kind`), whether or not a labelled series has a sample yet.
    declared = dict(line.split()[2:4] for line in body.decode().splitlines() if line.startswith("# TYPE "))
    samples = {f"{name}{suffix}" for name, kind in declared.items()
               for suffix in (("_bucket", "_sum", "_count") if kind == "histogram" else ("",))}
    queried = dashboard_metrics()
    assert {"xllm:time_to_first_token_seconds_bucket", "xllm:num_requests_waiting",
            "xllm:slot_busy_seconds_total"} <= queried
    families = {n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for n in queried - samples}
    assert families <= not_yet_in_the_source(EXPECTED_FROM_BEAM_ENGINE), f"queried, not exported: {families}"


def test_replicas_reload_signals_every_replica(tmp_path):
    """deploy/replicas.sh reload sends SIGHUP to each replica it started (stand-ins that record it)."""
    import subprocess
    import sys

    from .conftest import ROOT

    stand_in = ("import signal, sys, time\n"
                "signal.signal(signal.SIGHUP, lambda *_: (open(sys.argv[1], 'w').write('hup'), sys.exit(0)))\n"
                "print('ready', flush=True)\n"
                "time.sleep(120)\n")
    procs = []
    for i in range(2):
        proc = subprocess.Popen([sys.executable, "-c", stand_in, str(tmp_path / f"hup-{i}")], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "ready"  # its handler is in place
        (tmp_path / f"replica-{i}.pid").write_text(str(proc.pid))
        procs.append(proc)
    try:
        result = subprocess.run(["bash", os.path.join(ROOT, "deploy", "replicas.sh"), "reload"], capture_output=True,
                                text=True, env={**os.environ, "RUN_DIR": str(tmp_path)}, timeout=60)
        assert result.returncode == 0, result.stderr
        for proc in procs:
            assert proc.wait(60) == 0
        assert [(tmp_path / f"hup-{i}").read_text() for i in range(2)] == ["hup", "hup"]
    finally:
        for proc in procs:
            proc.kill()


def send_as_user(port: int, request_id: str, user: str | None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
    headers = {"content-type": "application/json", "x-request-id": request_id}
    if user is not None:
        headers["x-user-id"] = user
    conn.request("POST", "/v1/completions", orjson.dumps(request_body(PROMPTS[0], False)), headers)
    status = conn.getresponse().status
    conn.close()
    return status


def wait_idle(fleet) -> None:
    """Until HAProxy holds no request on any replica: it counts a request as outstanding until its
    stream ends, which may be just after the client read the answer, and an outstanding one would
    count against the replica's share (hash-balance-factor) for the next."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = fleet.admin.command("show stat").splitlines()
        header = lines[0].lstrip("# ").split(",")
        name, current = header.index("svname"), header.index("scur")
        if all(row[current] in ("", "0") for row in (line.split(",") for line in lines[1:] if line)
               if row[name].startswith("r")):
            return
        time.sleep(0.005)
    raise AssertionError("HAProxy still holds requests")


@needs_haproxy
def test_each_users_requests_land_on_one_replica(fleet):
    """One request at a time (no replica is ever loaded past the factor): 12 users' requests, in
    turn, each user always on the same replica, the users spread over more than one."""
    for i in range(len(fleet.replicas)):  # an earlier test may have restarted one
        fleet.admin.wait_status(f"r{i}", "UP")
    sent = {}
    for n in range(4):
        for u in range(12):
            request_id = f"affinity-{u}-{n}"
            wait_idle(fleet)
            assert send_as_user(fleet.port, request_id, f"user-{u}") == 200
            sent[request_id] = f"user-{u}"
    log = {request_id: line[1] for request_id, line in fleet.logged(sent).items()}
    replicas: dict[str, set] = {}
    for request_id, user in sent.items():
        assert log[request_id].startswith("users/"), log[request_id]
        replicas.setdefault(user, set()).add(log[request_id])
    assert all(len(where) == 1 for where in replicas.values()), replicas
    assert len(set().union(*replicas.values())) > 1


@needs_haproxy
def test_a_hot_user_spills_over_to_other_replicas(fleet):
    """Eight clients at once, all one user: with consistent hashing alone one replica would take
    them all; the balance factor passes what exceeds 1.5x the average on to the next replicas."""
    results = []

    def client(i: int) -> None:
        for n in range(6):
            results.append(send_as_user(fleet.port, f"hot-{i}-{n}", "hot-user"))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [200] * 48
    served = [line[1] for line in fleet.logged(f"hot-{i}-{n}" for i in range(8) for n in range(6)).values()]
    assert len(served) == 48 and len(set(served)) > 1, served
