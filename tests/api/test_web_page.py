"""The web page in a real browser: `prima serve` on a real 3-daemon local ring, the page opened in
headless Chromium (Debian's chromium package, driven by Playwright with no browser download).

The ring is the README's quick start: each daemon keeps 25 MiB of layer weights (11 of SmolLM2's
30 layers), so Halda splits the model across all three. The page shows the three nodes with the
windows the plan gave them and Halda's prediction, streams a chat answer equal to the API's own
greedy answer, and stops a long answer with the Stop button. The screenshot is kept in
the test's tmp_path; PRIMA_UPDATE_SCREENSHOT=1 also writes it to docs/images/web.png (the README's).
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..conftest import lines_until, popen_with_stderr_lines

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
README_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "web.png"
START_TIMEOUT_S = 900.0  # kernels compile on a first run; a bound for a loaded CI machine
UI_WAIT_MS = 60_000  # the page drawing what the server already answered
GENERATE_WAIT_MS = 600_000  # an answer (a token can be slow on a busy machine)
STOP_TIMEOUT_S = 60.0
MEM_BUDGET = "25M"  # per daemon; Halda cannot leave one out: two hold 22 of the 30 layers
MAX_LAYERS = 11  # SmolLM2's layers in 25 MiB (2.1 MiB each)
QUESTION = "Which city is the capital of France?"


@pytest.fixture(scope="module")
def chromium() -> str:
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); the page test needs it")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'")
    return CHROMIUM


@pytest.fixture(scope="module")
def served(smollm2_path: Path) -> Iterator[tuple[str, list[str]]]:
    """`prima serve --local-ring 3 --mem-budget 25M` on 127.0.0.1:0: its URL, read from the line
    it prints once it listens, and the lines it printed until then. Stopped with SIGINT (Ctrl-C),
    which also stops its daemons."""
    del smollm2_path  # fetched by the fixture; the command names the model
    cmd = [sys.executable, "-m", "prima.cli.main", "serve", "--local-ring", "3", "--mem-budget", MEM_BUDGET]
    cmd += ["--port", "0", "-n", "32"]
    proc, lines = popen_with_stderr_lines(cmd)
    try:
        yield _wait_for_url(lines, proc)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)


def _wait_for_url(lines: queue.Queue[str | None], proc: subprocess.Popen[str]) -> tuple[str, list[str]]:
    pattern = r"web page at (http://\S+/)"
    seen = lines_until(lines, proc, pattern, START_TIMEOUT_S)
    found = re.search(pattern, seen[-1])
    assert found is not None
    return found.group(1), seen


def _api(url: str, method: str, path: str, body: Any = None) -> Any:
    """One request straight to the server (http.client: no proxy settings in the way)."""
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=GENERATE_WAIT_MS / 1000)
    try:
        conn.request(method, path, None if body is None else json.dumps(body))
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        return json.loads(resp.read())
    finally:
        conn.close()


def test_page_chats_and_shows_the_ring(chromium: str, served: tuple[str, list[str]], tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    url, printed = served
    view = _api(url, "GET", "/v1/cluster")
    windows = {n["node_id"]: n["windows"] for n in view["nodes"]}
    assert sorted(windows) == ["node0", "node1", "node2"]
    # One round (more would only add hops), each window within its daemon's budget.
    assert all(len(w) == 1 and 0 < w[0][1] - w[0][0] <= MAX_LAYERS for w in windows.values())
    assert view["predicted_ms_per_token"] > 0
    # serve said so in its plan line before it listened, the nodes in the order they run.
    (plan_line,) = [line for line in printed if line.startswith("prima: plan: ")]
    in_order = sorted(windows.items(), key=lambda item: item[1][0][0])
    assert ", ".join(f"{n} [{w[0][0]},{w[0][1]})" for n, w in in_order) in plan_line
    assert f"Halda predicts {view['predicted_ms_per_token']:.1f} ms/token" in plan_line
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.set_default_timeout(UI_WAIT_MS)
            expect.set_options(timeout=UI_WAIT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url)

            # The three nodes, each with its window.
            nodes = page.locator("article.node")
            expect(nodes).to_have_count(3)
            for node_id, [[start, end]] in windows.items():
                card = page.locator(f'article.node[data-node="{node_id}"]')
                expect(card.locator("dd.windows")).to_have_text(f"round 1: [{start},{end})")
                expect(card).to_contain_text("resident of")
                expect(card).to_contain_text("budget 25.0 MiB")
                expect(card).to_contain_text("RAM: Halda plans with")
                expect(card).to_contain_text("predicted")
            expect(page.locator("#summary")).to_contain_text("predicted")

            # A chat message, streamed; greedy, so it must equal the API's own answer.
            page.locator("#sampling summary").click()
            page.locator("#temperature").fill("0")
            page.locator("#max_tokens").fill("24")
            page.locator("#prompt").fill(QUESTION)
            page.locator("#prompt").press("Enter")
            reply = page.locator("article.message.assistant").last
            expect(reply.locator(".meta")).to_contain_text("tokens", timeout=GENERATE_WAIT_MS)
            expect(page.locator("#send")).to_be_enabled()
            expected = _api(
                url,
                "POST",
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 24},
            )["choices"][0]["message"]["content"]
            assert reply.locator(".text").text_content() == expected

            # The cluster view catches up with the requests it served.
            expect(page.locator("#summary")).to_contain_text("over 2 request(s)")
            # Every hop of the forward pass with the time its node measured per decode step.
            hops = page.locator("#hops li.hop")
            expect(hops).to_have_count(3)
            for i in range(3):
                expect(hops.nth(i)).to_contain_text("ms compute")
            page.screenshot(path=tmp_path / "web.png", full_page=True)
            if os.environ.get("PRIMA_UPDATE_SCREENSHOT") == "1":
                README_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(tmp_path / "web.png", README_SCREENSHOT)

            # Stop ends a long answer early and frees the model for the next one.
            page.locator("#max_tokens").fill("2000")
            page.locator("#prompt").fill("Write a long story about a lighthouse.")
            page.locator("#send").click()
            long_reply = page.locator("article.message.assistant").last
            expect(long_reply.locator(".text")).not_to_be_empty(timeout=GENERATE_WAIT_MS)
            page.locator("#stop").click()
            expect(long_reply.locator(".meta")).to_have_text("stopped")
            expect(page.locator("#send")).to_be_enabled()
            assert errors == []
        finally:
            browser.close()
    # The stopped request freed the model: the next one is answered.
    done = _api(url, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert done["usage"]["completion_tokens"] >= 1
