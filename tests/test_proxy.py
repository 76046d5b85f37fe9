"""HTTP proxies: which one the standard variables pick, and whole runs through a real proxy."""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trustme
from conftest import (
    FAST_SIM,
    Run,
    error_lines,
    only_run,
    read_jsonl,
    run_cli,
    write_input,
    write_job,
)

from shardrun.errors import SpecError
from shardrun.proxy import Proxy, bypassed, proxy_for
from shardrun.sim.config import SimConfig
from shardrun.sim.launcher import start_sim

FORWARD_PROXY = Path(__file__).parent / "forward_proxy.py"
CLOSED = "127.0.0.1:1"  # nothing listens on port 1: a direct connection is refused


def basic(user_pass: str) -> str:
    return "Basic " + base64.b64encode(user_pass.encode()).decode()


# -- which proxy -------------------------------------------------------------------------------


def test_the_variable_follows_the_endpoints_scheme_and_lower_case_wins() -> None:
    env = {"HTTPS_PROXY": "http://upper:1", "https_proxy": "http://lower:2",
           "HTTP_PROXY": "http://plain:3", "ALL_PROXY": "http://all:4"}  # fmt: skip
    assert proxy_for("https://api.example.com/v1", env) == Proxy("http://lower:2", "https_proxy")
    assert proxy_for("http://api.example.com/v1", env) == Proxy("http://plain:3", "HTTP_PROXY")
    assert proxy_for("https://a/v1", {"ALL_PROXY": "http://all:4"}) == Proxy("http://all:4",
                                                                             "ALL_PROXY")
    assert proxy_for("https://a/v1", {"HTTP_PROXY": "http://plain:3"}) is None
    assert proxy_for("https://a/v1", {"https_proxy": "  ", "HTTPS_PROXY": "h:5"}) == Proxy(
        "http://h:5", "HTTPS_PROXY")  # blank is unset; a bare host:port is an HTTP proxy
    assert proxy_for("https://a/v1", {}) is None


def test_no_proxy_exempts_names_domains_networks_and_ports() -> None:
    assert bypassed("api.corp.example", 443, "localhost, .corp.example")
    assert bypassed("corp.example", 443, "corp.example")
    assert not bypassed("xcorp.example", 443, "corp.example")
    assert bypassed("API.Corp.Example.", 443, "corp.example")
    assert bypassed("10.1.2.3", 8000, "10.0.0.0/8") and not bypassed("11.1.2.3", 8000, "10.0.0.0/8")
    assert bypassed("::1", 8000, "::1") and bypassed("::1", 8000, "[::1]:8000")
    assert not bypassed("::1", 8001, "[::1]:8000")
    assert bypassed("h", 81, "h:81") and not bypassed("h", 80, "h:81")
    assert bypassed("anything", None, "*")
    assert not bypassed("h", 80, " , ")
    # Through proxy_for: the port an entry names is the URL's, or its scheme's default.
    env = {"HTTPS_PROXY": "http://p:3128", "NO_PROXY": "api.example.com:443"}
    assert proxy_for("https://api.example.com/v1", env) is None
    assert proxy_for("https://api.example.com:8443/v1", env) is not None
    env = {"https_proxy": "http://p:3128", "no_proxy": "", "NO_PROXY": "*"}
    assert proxy_for("https://a/v1", env) is None  # a blank no_proxy is unset, as proxies are


def test_credentials_become_a_header_never_part_of_the_url() -> None:
    proxy = proxy_for("https://a/v1", {"HTTPS_PROXY": "http://alice%40corp:p%3Ass@proxy:3128"})
    assert proxy == Proxy("http://proxy:3128", "HTTPS_PROXY", basic("alice@corp:p:ss"))
    assert proxy.describe() == {"url": "http://proxy:3128", "from": "HTTPS_PROXY"}
    assert proxy_for("https://a/v1", {"HTTPS_PROXY": "http://[::1]"}) == Proxy(
        "http://[::1]:80", "HTTPS_PROXY")


@pytest.mark.parametrize(("value", "message"), [
    ("socks5://proxy:1080", "environment variable ALL_PROXY names a socks5 proxy "
                            "(socks5://proxy...); shardrun connects through HTTP proxies only "
                            "(http://host:port): change or unset it, or add the endpoint's host "
                            "to no_proxy"),
    ("http://proxy:99999", "environment variable ALL_PROXY does not name a proxy as "
                           "http://host:port (its host or port is missing or not valid)"),
    ("http://:3128", "environment variable ALL_PROXY does not name a proxy as http://host:port "
                     "(its host or port is missing or not valid)"),
    ("http://[::1:3128", "environment variable ALL_PROXY does not name a proxy as "
                         "http://host:port (its host or port is missing or not valid)"),
])  # fmt: skip
def test_a_proxy_variable_that_cannot_be_used_is_an_error_naming_it(value: str,
                                                                   message: str) -> None:
    with pytest.raises(SpecError) as caught:
        proxy_for("https://a/v1", {"ALL_PROXY": value})
    assert str(caught.value) == message


# -- whole runs through a real proxy process ---------------------------------------------------


@contextmanager
def forward_proxy(log: Path, *args: str) -> Iterator[int]:
    """tests/forward_proxy.py as its own process; yields its port, stops it by closing stdin."""
    proc = subprocess.Popen([sys.executable, str(FORWARD_PROXY), str(log), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        yield int(line.split()[-1])
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_closed_job(tmp_path: Path, scheme: str = "http") -> None:
    """job.yaml for an endpoint that refuses direct connections (nothing listens on port 1)."""
    write_job(tmp_path / "job.yaml", endpoint={"base_url": f"{scheme}://{CLOSED}/v1",
                                               "api": "chat", "model": "m"})  # fmt: skip


@contextmanager
def proxy_to_sim(log: Path, *args: str) -> Iterator[int]:
    """A simulator, and a forward proxy that takes every connection there; yields its port."""
    with start_sim(SimConfig.from_mapping(FAST_SIM)) as sim:
        upstream = sim.base_url.split("/")[2]  # host:port
        with forward_proxy(log, "--upstream", upstream, *args) as port:
            yield port


def test_a_run_goes_through_the_proxy_with_its_credentials(tmp_path: Path,
                                                          no_stray_children: None) -> None:
    """HTTP_PROXY with credentials: every request reaches the endpoint through the proxy (the
    endpoint's own address refuses connections; only the proxy knows where the simulator is),
    each connection to the proxy carries Proxy-Authorization, the manifest names the proxy, and
    no file of the run holds the password."""
    ids = write_input(tmp_path / "input.jsonl", 300)
    write_closed_job(tmp_path)
    log = tmp_path / "proxy.jsonl"
    with proxy_to_sim(log) as port:
        proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path,
                       env={"HTTP_PROXY": f"http://alice:s3cr%40t@127.0.0.1:{port}"})
    assert proc.returncode == 0, proc.stderr
    run = Run.load(only_run(tmp_path / "runs"))
    assert sorted(r["id"] for r in run.results) == ids
    seen = read_jsonl(log)
    assert 1 <= len(seen) <= 2 * 8  # kept-alive connections: at most shards x cap of them
    assert {(s["method"], s["target"], s["auth"]) for s in seen} == {
        ("POST", f"http://{CLOSED}/v1/chat/completions", basic("alice:s3cr@t"))}
    assert run.manifest["proxy"] == {"url": f"http://127.0.0.1:{port}", "from": "HTTP_PROXY"}
    secrets = (b"s3cr", basic("alice:s3cr@t").split()[1].encode())
    for path in run.path.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(secret in data for secret in secrets), path


def test_no_proxy_sends_the_endpoint_past_the_proxy(tmp_path: Path) -> None:
    """NO_PROXY lists the endpoint: the run connects directly (here: refused, so every item fails
    with that cause and the run ends with exit 1), and the proxy sees nothing."""
    write_input(tmp_path / "input.jsonl", 20)
    write_closed_job(tmp_path)
    log = tmp_path / "proxy.jsonl"
    log.touch()
    with forward_proxy(log) as port:
        proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path,
                       env={"HTTP_PROXY": f"127.0.0.1:{port}", "NO_PROXY": "localhost,127.0.0.1"})
    assert proc.returncode == 1, proc.stderr
    assert f"connection refused by {CLOSED}" in proc.stdout + proc.stderr
    assert read_jsonl(log) == []
    assert Run.load(only_run(tmp_path / "runs")).manifest["proxy"] is None


def test_the_embedded_simulator_is_never_proxied(tmp_path: Path) -> None:
    """sim:// is a process of the run itself: a proxy variable (here one naming a closed port)
    changes nothing."""
    ids = write_input(tmp_path / "input.jsonl", 50)
    write_job(tmp_path / "job.yaml")
    proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path,
                   env={"HTTP_PROXY": f"http://{CLOSED}", "ALL_PROXY": f"http://{CLOSED}"})
    assert proc.returncode == 0, proc.stderr
    run = Run.load(only_run(tmp_path / "runs"))
    assert sorted(r["id"] for r in run.results) == ids
    assert run.manifest["proxy"] is None


def test_an_https_run_goes_through_a_connect_tunnel(tmp_path: Path,
                                                   no_stray_children: None) -> None:
    """HTTPS_PROXY with credentials and an https endpoint: each connection opens a CONNECT
    tunnel that carries Proxy-Authorization, TLS to the endpoint is verified (its CA comes
    from SSL_CERT_FILE) and inside the tunnel the endpoint never sees the proxy's credentials."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(tmp_path / "endpoint.pem"))
    ids = write_input(tmp_path / "input.jsonl", 300)
    write_closed_job(tmp_path, "https")
    log = tmp_path / "proxy.jsonl"
    right = basic("alice:right")
    with proxy_to_sim(log, "--require", right, "--tls", str(tmp_path / "endpoint.pem")) as port:
        proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path,
                       env={"HTTPS_PROXY": f"http://alice:right@127.0.0.1:{port}",
                            "SSL_CERT_FILE": str(tmp_path / "ca.pem")})
    assert proc.returncode == 0, proc.stderr
    run = Run.load(only_run(tmp_path / "runs"))
    assert sorted(r["id"] for r in run.results) == ids
    seen = read_jsonl(log)
    tunnels = [s for s in seen if s["method"] == "CONNECT"]
    assert 1 <= len(tunnels) <= 2 * 8
    assert {(s["target"], s["auth"]) for s in tunnels} == {(CLOSED, right)}
    inside = [s for s in seen if s["method"] == "tunnel"]
    assert len(inside) == len(tunnels)
    assert {(s["target"], s["auth"]) for s in inside} == {("/v1/chat/completions", None)}
    assert run.manifest["proxy"] == {"url": f"http://127.0.0.1:{port}", "from": "HTTPS_PROXY"}


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_proxy_that_refuses_the_credentials_stops_the_run(tmp_path: Path, scheme: str) -> None:
    """HTTP 407, to a plain request (http) or to the CONNECT that opens a tunnel (https): one
    message that says what to fix, nothing dead-lettered, the items left for --resume."""
    write_input(tmp_path / "input.jsonl", 200)
    write_closed_job(tmp_path, scheme)
    log = tmp_path / "proxy.jsonl"
    with forward_proxy(log, "--require", basic("alice:right")) as port:
        proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path,
                       env={f"{scheme.upper()}_PROXY": f"http://alice:wrong@127.0.0.1:{port}"})
    assert proc.returncode == 1, proc.stderr
    errors = error_lines(proc.stderr, tmp_path)
    assert len(errors) == 1 and errors[0].startswith(
        "error: the proxy refused the credentials (HTTP 407"), proc.stderr
    assert errors[0].endswith("set them in the proxy variable as "
                              "http://user:password@host:port, then continue with --resume"
                              ), errors[0]
    assert "HTTP 407: HTTP 407" not in errors[0] and "the proxy answered" not in errors[0]
    run = Run.load(only_run(tmp_path / "runs"))
    assert not run.dead and not run.results
    seen = read_jsonl(log)
    assert seen and len(seen) < 100
    assert {s["method"] for s in seen} == {"CONNECT" if scheme == "https" else "POST"}


def test_a_bad_proxy_variable_is_a_usage_error(tmp_path: Path) -> None:
    """Exit 2 and one line naming the variable, before any run directory exists."""
    write_input(tmp_path / "input.jsonl", 5)
    write_job(tmp_path / "job.yaml", endpoint={"base_url": "https://api.example.com/v1",
                                               "api": "chat", "model": "m"})  # fmt: skip
    proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path,
                   env={"HTTPS_PROXY": "socks5://127.0.0.1:1080"})
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: environment variable HTTPS_PROXY names a socks5 proxy (socks5://127.0.0.1...); "
        "shardrun connects through HTTP proxies only (http://host:port): change or unset it, "
        "or add the endpoint's host to no_proxy"]
    assert not (tmp_path / "runs").exists()


def test_validate_ping_goes_through_the_proxy_and_says_so(tmp_path: Path) -> None:
    """`validate --ping` sends its request the way a run would, and names the proxy."""
    write_input(tmp_path / "input.jsonl", 3)
    write_closed_job(tmp_path)
    log = tmp_path / "proxy.jsonl"
    with proxy_to_sim(log) as port:
        proc = run_cli("validate", "job.yaml", "--ping", cwd=tmp_path,
                       env={"http_proxy": f"http://127.0.0.1:{port}"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"ping: ok (HTTP 200) http://{CLOSED}/v1/chat/completions: " in proc.stdout
    assert f"\n  through the proxy http://127.0.0.1:{port} (from http_proxy)\n" in proc.stdout
    assert [s["target"] for s in read_jsonl(log)] == [f"http://{CLOSED}/v1/chat/completions"]


def test_the_jobs_headers_and_the_key_in_a_header_of_its_choosing(tmp_path: Path) -> None:
    """`endpoint.headers` go with every request as given; `api_key_header: api-key` carries the
    key as it is, and no Authorization header is sent. Seen on the wire, by the proxy the
    requests pass through."""
    ids = write_input(tmp_path / "input.jsonl", 40)
    write_job(tmp_path / "job.yaml", endpoint={
        "base_url": f"http://{CLOSED}/v1", "api": "chat", "model": "m", "api_key_env": "KEY",
        "api_key_header": "api-key", "headers": {"X-Org": "acme", "OpenAI-Beta": "x=1"}})
    log = tmp_path / "proxy.jsonl"
    with proxy_to_sim(log) as port:
        proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path,
                       env={"HTTP_PROXY": f"http://127.0.0.1:{port}", "KEY": "sk-test-4242"})
    assert proc.returncode == 0, proc.stderr
    run = Run.load(only_run(tmp_path / "runs"))
    assert sorted(r["id"] for r in run.results) == ids
    seen = read_jsonl(log)
    assert seen
    for request in seen:
        names = {name.lower(): value for name, value in request["headers"].items()}
        assert names["api-key"] == "sk-test-4242"
        assert names["x-org"] == "acme" and names["openai-beta"] == "x=1"
        assert "authorization" not in names
    effective = run.manifest["effective"]
    assert effective["endpoint.headers"]["value"] == {"X-Org": "acme", "OpenAI-Beta": "x=1"}
    assert effective["endpoint.api_key_header"]["value"] == "api-key"
    for path in run.path.rglob("*"):
        if path.is_file():
            assert b"sk-test-4242" not in path.read_bytes(), path


def test_a_query_in_the_base_url_reaches_every_request(tmp_path: Path) -> None:
    """`?api-version=...` (Azure OpenAI deployments) stays after the path on the wire."""
    ids = write_input(tmp_path / "input.jsonl", 20)
    write_job(tmp_path / "job.yaml", endpoint={
        "base_url": f"http://{CLOSED}/v1?api-version=2024-10-21", "api": "chat", "model": "m"})
    log = tmp_path / "proxy.jsonl"
    with proxy_to_sim(log) as port:
        proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path,
                       env={"HTTP_PROXY": f"http://127.0.0.1:{port}"})
    assert proc.returncode == 0, proc.stderr
    assert sorted(r["id"] for r in Run.load(only_run(tmp_path / "runs")).results) == ids
    assert {s["target"] for s in read_jsonl(log)} == {
        f"http://{CLOSED}/v1/chat/completions?api-version=2024-10-21"}


def test_a_no_proxy_port_of_a_digit_that_is_no_number_is_read_as_no_port() -> None:
    """'²' is a digit to str.isdigit but no number to int(): NO_PROXY=h:² raised ValueError (a
    traceback from every command that reaches the endpoint); it reads as h:x does."""
    assert bypassed("h", 80, "h:²") == bypassed("h", 80, "h:x")
