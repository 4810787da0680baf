"""The playground page (orchestrator/static) in a real browser: headless Chromium, driven by
Selenium, against the three services on loopback. It submits a prompt, waits for the streamed
reply, checks the shaded rounds and the statistics, and saves a screenshot
(bench-results/playground.png, and the test's tmp folder)."""

from __future__ import annotations

import json
import re
import shutil
import tempfile

import pytest

from orchestrator.openai_api import serve_http
from specdec.serving.security import ClientSecurity, ServerSecurity
from specdec.v1 import orchestrator_pb2
from tests.harness import ROOT, pipeline

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; .ci/run does)",
)
MODEL = "tiny-target"
PROMPT = "tell me about speculative decoding."
MAX_TOKENS = 60


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(dir=tmp_path)  # a fresh profile; the machine may have no internet
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1280,800",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.slow
def test_the_playground_streams_a_reply_with_shaded_rounds_and_statistics(tiny_backends, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with pipeline(tiny_backends["draft"], tiny_backends["target"]) as p:
        http = serve_http(p.addresses["orchestrator"], "127.0.0.1", 0, ClientSecurity(), ServerSecurity(), model=MODEL)
        try:
            browser.get(http.url + "/")
            wait = WebDriverWait(browser, 60)
            wait.until(lambda b: b.find_element(By.ID, "model").text == MODEL)

            def generate(**fields):  # fill the fields, send, wait for the reply; its element
                for field, value in fields.items():
                    box = browser.find_element(By.ID, field)
                    box.clear()
                    box.send_keys(value)
                browser.find_element(By.ID, "send").click()
                wait.until(lambda b: b.find_element(By.ID, "reply").get_attribute("data-state") in ("done", "error"))
                assert browser.find_element(By.ID, "error").text == ""
                return browser.find_element(By.ID, "reply")

            reply = generate(prompt=PROMPT, max_tokens=str(MAX_TOKENS))
            text = browser.execute_script("return arguments[0].textContent", reply)
            rounds = len(reply.find_elements(By.CSS_SELECTOR, ".round"))
            drafted = reply.find_elements(By.CSS_SELECTOR, ".round > .drafted")
            drafted = [e.get_attribute("textContent") for e in drafted]
            supplied = len(reply.find_elements(By.CSS_SELECTOR, ".round > .target"))
            stats = {n: browser.find_element(By.ID, f"stat-{n}").text for n in ("rounds", "tokens", "acceptance")}
            for path in (tmp_path / "playground.png", ROOT / "bench-results" / "playground.png"):
                path.parent.mkdir(exist_ok=True)
                assert browser.save_screenshot(str(path))
            print(f"screenshot: {ROOT / 'bench-results' / 'playground.png'}")
            # A draft tree: the accepted path is each round's drafted span, and the text is the same.
            reply = generate(tree_nodes="6")
            tree_text = browser.execute_script("return arguments[0].textContent", reply)
            tree_drafted = len(reply.find_elements(By.CSS_SELECTOR, ".round > .drafted"))
            # A JSON schema: the reply is JSON that follows it (the tiny tokenizer has digits, no braces).
            reply = generate(tree_nodes="0", schema='{"type": "integer", "minimum": 0, "maximum": 999}')
            number = browser.execute_script("return arguments[0].textContent", reply)
        finally:
            http.stop()
        # The page shows what the gRPC API returns for the same request (greedy: the same text).
        messages = orchestrator_pb2.ChatMessages(messages=[orchestrator_pb2.ChatMessage(role="user", content=PROMPT)])
        ref = p.orchestrator.Generate(orchestrator_pb2.GenerateRequest(messages=messages, max_new_tokens=MAX_TOKENS))
    assert text == ref.text
    # A box per committed round with text: the target's token closes each; accepted drafts lead some.
    # The rounds are the page's own request's: how many ran before the draft's session was open is
    # timing (greedy rounds do not wait for it), so another request's count may differ.
    assert 1 < rounds <= int(stats["rounds"])
    assert supplied == rounds and len(drafted) > 0
    drafted_text = sum(len(t) for t in drafted)
    assert 0 < drafted_text < len(text)
    assert stats["tokens"] == str(MAX_TOKENS)
    assert re.fullmatch(r"\d{1,3}\.\d %", stats["acceptance"]) and float(stats["acceptance"][:-2]) > 0
    assert tree_text == text and tree_drafted
    assert number.isdigit() and 0 <= json.loads(number) <= 999
