"""Chat with the bundled demo through Open WebUI in headless Chromium, as a new user would, and say
step by step what worked: examples/open_webui.sh runs it once per connection (Ollama, OpenAI) against a
fresh Open WebUI. Each step prints PASS or FAIL with what it saw; screenshots go to --shots. Run with
the Python that has playwright (the script's venv), not the project's.

What a step checks comes from three places: the page (what the user sees), Open WebUI's socket.io
events to the page (``chat:title``, ``chat:message:follow_ups``) and the server's own log
(``--log-level debug``: every request's body in outline as it arrives, every refusal with its reason).
Sampling settings are checked against the server itself: the answer Open WebUI shows for a setting must
be the one the server gives the same request sent straight to it (same seed), and differ from the
answer without the setting.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

from playwright.sync_api import sync_playwright

MODEL = "mlx-dgemma-demo"
FIRST, FIRST_ANSWER = "reverse: planet", "tenalp"  # the demo reverses every word it is given
SECOND = "sort: 42 17 85 23 61"
LONG = "sort: " + " ".join(str(i) for i in range(99, 0, -1))  # answered with thousands of tokens, varying by seed
SEED = 7
# The settings the chat controls change, each with the value set and the name the server's log and a
# direct request give it (Ollama's options, OpenAI's body). top_k 1 draws greedily, so it changes the
# answer wherever the default temperature draws another token than the likeliest; a larger k kept
# every token the demo draws at this seed.
KNOBS = [("Temperature", 0.3, "temperature"), ("top_k", 1, "top_k"), ("top_p", 0.5, "top_p")]
# Open WebUI's own prompts for its background tasks begin with these.
TASKS = {
    "title": "Generate a concise title",
    "follow-ups": "Predict 3-5 useful messages",
    "tags": "Generate 1-3 broad tags",
}
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LOGGED = re.compile(r"^(\S+ \S+) (DEBUG|INFO|ERROR) mlx_dgemma\.server: #(\d+) (\S+) (.*)$")
ACCESS = re.compile(r'"(GET|POST|PUT|DELETE|HEAD|OPTIONS) (\S+) HTTP/[\d.]+" (\d{3})')


class ServerLog:
    """The server's log from where this run began: its requests (number, time, path, body outline),
    its refusals and the status of every response uvicorn logged."""

    def __init__(self, path: Path):
        self.path = path
        self.start = path.stat().st_size

    def lines(self) -> list[str]:
        with open(self.path, encoding="utf-8", errors="replace") as f:
            f.seek(self.start)
            return f.read().split("\n")

    def requests(self) -> list[dict]:
        found = []
        for line in self.lines():
            m = LOGGED.match(line)
            if m and m.group(2) == "DEBUG":
                found.append(
                    {"number": int(m.group(3)), "time": m.group(1), "path": m.group(4), "body": json.loads(m.group(5))}
                )
        return found

    def refusals(self) -> list[str]:
        return [line for line in self.lines() if (m := LOGGED.match(line)) and m.group(2) != "DEBUG"]

    def client_errors(self) -> list[str]:
        """uvicorn's lines of every 4xx (and 5xx) answered."""
        return [
            f"{m.group(1)} {m.group(2)} {m.group(3)}"
            for line in self.lines()
            if (m := ACCESS.search(line)) and m.group(3)[0] in "45"
        ]


def logged(text: str) -> str:
    """``text`` as the server's log shows it (request_log.outline: longer than 60 characters, cut)."""
    return text if len(text) <= 60 else f"{text[:60]}… ({len(text)} characters)"


def first_text(body: dict) -> str:
    messages = body.get("messages") or [{}]
    content = messages[0].get("content")
    return content if isinstance(content, str) else ""


def option(body: dict, name: str):
    """A setting as the request carried it: Ollama's in ``options``, OpenAI's in the body."""
    return (body.get("options") or {}).get(name, body.get(name))


class Run:
    def __init__(self, args):
        self.args = args
        self.connection = args.connection
        self.log = ServerLog(Path(args.server_log))
        self.shots = Path(args.shots)
        self.shots.mkdir(parents=True, exist_ok=True)
        self.results: list[tuple[str, bool, str]] = []
        self.events: list[dict] = []  # Open WebUI's socket.io events to the page
        self.shot_number = 0

    # -- reporting --------------------------------------------------------------------------------

    def step(self, name: str, ok: bool, detail: str) -> bool:
        self.results.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'} [{self.connection}] {name}: {detail}", flush=True)
        return ok

    def shot(self, page, name: str) -> None:
        self.shot_number += 1
        path = self.shots / f"{self.connection}-{self.shot_number:02d}-{name}.png"
        page.screenshot(path=str(path))
        print(f"     screenshot {path}", flush=True)

    # -- the page ---------------------------------------------------------------------------------

    def on_websocket(self, socket) -> None:
        def received(frame):
            if isinstance(frame, str) and frame.startswith("42") and '"chat:' in frame:
                try:
                    name, payload = json.loads(frame[2:])[:2]
                except ValueError:
                    return
                if name == "events" and isinstance(payload, dict):
                    self.events.append({**payload.get("data", {}), "at": time.monotonic()})

        socket.on("framereceived", received)

    def event(self, page, kind: str, after: float, timeout: float):
        """The data of the first ``kind`` event since ``after``, waited for up to ``timeout`` seconds
        (in the page's own wait: playwright delivers events only while it is called)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events:
                if e.get("type") == kind and e["at"] >= after:
                    return e.get("data")
            page.wait_for_timeout(250)
        return None

    def new_chat(self, page) -> None:
        page.goto(self.args.webui + "/", wait_until="domcontentloaded")
        page.wait_for_selector("#chat-input", timeout=120_000)
        page.get_by_label(f"Selected model: {MODEL}").wait_for(timeout=60_000)
        notes = page.get_by_role("button", name="Okay, Let's Go!")  # the release notes a first visit shows
        if notes.count():
            notes.click()

    def send(self, page, text: str, wait: bool = True, timeout: float = 180) -> tuple[str, float]:
        """Type ``text`` and send it; with ``wait``, the answer once it is finished (its Regenerate
        button is shown) and the seconds that took."""
        answers = page.locator("#response-content-container").count()
        page.locator("#chat-input").click()
        page.keyboard.type(text)
        started = time.monotonic()
        self.sent_at = time.time()
        page.keyboard.press("Enter")
        page.locator("#response-content-container").nth(answers).wait_for(timeout=timeout * 1000)
        if not wait:
            return "", time.monotonic() - started
        self.finished(page, answers, timeout)
        return self.answer(page), time.monotonic() - started

    def finished(self, page, index: int, timeout: float = 180) -> None:
        message = (
            page.locator("#response-content-container")
            .nth(index)
            .locator("xpath=ancestor::div[starts-with(@id, 'message-')][1]")
        )
        message.get_by_role("button", name="Regenerate").wait_for(timeout=timeout * 1000)

    @staticmethod
    def answer(page) -> str:
        return page.locator("#response-content-container").last.inner_text().strip()

    def regenerate(self, page, answers: int) -> str:
        """The answer to the last message tried again, the chat's ``answers``-th to it (its "n/n" shows)."""
        index = page.locator("#response-content-container").count() - 1
        page.get_by_role("button", name="Regenerate").last.click()
        page.get_by_role("button", name="Try Again").click()
        page.get_by_text(f"{answers}/{answers}", exact=True).wait_for(timeout=120_000)
        self.finished(page, index)
        return self.answer(page)

    def control(self, page, name: str, value) -> None:
        """Set a chat control (Controls → Advanced Params) to ``value``; None sets it back to Default."""
        button = page.get_by_label(name, exact=True).and_(page.locator("button"))
        if not button.count():
            page.get_by_label("Controls").click()
            button.wait_for(timeout=10_000)
        custom = button.inner_text().strip() == "Custom"
        if (value is None) == custom:  # the toggle between Default and Custom
            button.click()
        if value is not None:
            field = page.locator(f'input[aria-label="{name}"]:not([type=range])')
            field.wait_for(timeout=10_000)
            field.fill(str(value))
            field.press("Tab")

    # -- the server -------------------------------------------------------------------------------

    def health(self) -> dict:
        with urllib.request.urlopen(self.args.server + "/health", timeout=30) as r:
            return json.load(r)

    def direct(self, messages: list[dict], settings: dict) -> str:
        """The answer the server gives ``messages`` with ``settings`` sent straight to it, in this
        connection's API."""
        if self.connection == "ollama":
            path, body = (
                "/api/chat",
                {
                    "model": MODEL,
                    "messages": messages,
                    "stream": False,
                    "options": {**settings, "num_predict": settings.get("max_tokens")},
                },
            )
            body["options"].pop("max_tokens")
        else:
            path, body = "/v1/chat/completions", {"model": MODEL, "messages": messages, **settings}
        request = urllib.request.Request(
            self.args.server + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                reply = json.load(r)
        except urllib.error.HTTPError as e:  # a setting the server refuses
            return f"(refused: {e.code} {e.read().decode(errors='replace')[:200]})"
        return (
            reply["message"]["content"] if self.connection == "ollama" else reply["choices"][0]["message"]["content"]
        ).strip()

    def reached(self, text: str, sent_at: float) -> float | None:
        """Seconds from ``sent_at`` (the Enter key) to the server's log of the chat request ending with ``text``."""
        for r in self.chat_requests(text):
            at = datetime.strptime(r["time"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at >= sent_at - 1:  # (the log's clock is this machine's, in milliseconds)
                return at - sent_at
        return None

    def chat_requests(self, text: str) -> list[dict]:
        """The chat requests (not Open WebUI's background tasks) whose last message is ``text``."""
        found = []
        for r in self.log.requests():
            messages = r["body"].get("messages") or []
            if (
                messages
                and messages[-1].get("content") == logged(text)
                and not any(p in first_text(r["body"]) for p in TASKS.values())
            ):
                found.append(r)
        return found

    # -- the steps --------------------------------------------------------------------------------

    def run(self) -> bool:
        with sync_playwright() as p:
            context = p.chromium.launch_persistent_context(
                tempfile.mkdtemp(prefix="mlx-dgemma-chromium-"),
                executable_path=self.args.chromium,
                args=CHROMIUM_FLAGS,
                headless=True,
                viewport={"width": 1400, "height": 900},
            )
            page = context.pages[0] if context.pages else context.new_page()
            page.on("websocket", self.on_websocket)
            page.set_default_timeout(60_000)
            try:
                self.conversation(page)
                self.stop(page)
                self.knobs(page)
                if self.args.repeat:
                    self.stall_check(page, self.args.repeat)
            except Exception as e:  # a page that never showed what a step waited for
                self.shot(page, "error")
                self.step("the run", False, f"{type(e).__name__}: {str(e).splitlines()[0]}")
            context.close()
        errors = self.log.client_errors()
        refusals = self.log.refusals()
        self.step(
            "no 4xx (or 5xx) in the server's log",
            not errors and not refusals,
            "none" if not errors and not refusals else "; ".join(errors + refusals)[:2000],
        )
        return all(ok for _, ok, _ in self.results)

    def conversation(self, page) -> None:
        self.new_chat(page)
        self.shot(page, "start")
        started = time.monotonic()
        text, took = self.send(page, FIRST)
        delay = self.reached(FIRST, self.sent_at)
        self.shot(page, "first-answer")
        self.step(
            "the first message answers",
            text == FIRST_ANSWER,
            f"{FIRST!r} -> {text!r} in {took:.1f} s (at the server {delay:.2f} s after Enter)",
        )

        text, took = self.send(page, SECOND)
        delay = self.reached(SECOND, self.sent_at)
        sent = self.chat_requests(SECOND)
        history = [[(m.get("role"), m.get("content")) for m in r["body"]["messages"]] for r in sent]
        carried = any(h[:2] == [("user", logged(FIRST)), ("assistant", logged(FIRST_ANSWER))] for h in history)
        self.step(
            "the second message carries the history",
            carried and bool(text),
            f"{SECOND!r} -> {text!r} in {took:.1f} s (at the server {delay:.2f} s after Enter); the server got {history[-1] if history else 'nothing'} "
            f"(the demo knows single prompts: with history it answers nonsense)",
        )

        title = self.event(page, "chat:title", started, 120)
        follow_ups = self.event(page, "chat:message:follow_ups", started, 120)
        page.wait_for_timeout(2000)
        self.shot(page, "title-and-follow-ups")
        requests = self.log.requests()
        refused = {int(m.group(1)) for line in self.log.refusals() if (m := re.search(r": #(\d+) ", line))}
        for task, opening in TASKS.items():
            sent = [r for r in requests if opening in first_text(r["body"])]
            answered = [r for r in sent if r["number"] not in refused]
            shown = {
                "title": f"; the chat's title is now {title!r}",
                "follow-ups": f"; Open WebUI shows {len((follow_ups or {}).get('follow_ups', []))} suggestions "
                "(it takes JSON of them, which the demo does not write)",
            }.get(task, "")
            self.step(
                f"{task} generated",
                bool(sent)
                and len(answered) == len(sent)
                and (task != "title" or title is not None)
                and (task != "follow-ups" or follow_ups is not None),
                f"{len(sent)} requests, {len(answered)} answered{shown}",
            )

    def stall_check(self, page, times: int) -> None:
        """``times`` more two-message chats, each second message sent as soon as the first is answered
        (while Open WebUI's title, follow-up and tag requests run): how long each took to reach the server."""
        delays = []
        probe = HealthProbe(self.args.server)
        for i in range(times):
            self.new_chat(page)
            first, second = f"reverse: stall{i}", f"reverse: again{i}"  # (each chat's own texts)
            for text in (first, second):
                _, took = self.send(page, text)
                delays.append((self.reached(text, self.sent_at), took))
        slowest = probe.stop()
        late = [d for d in delays if d[0] is None or d[0] > 10]
        self.step(
            f"every message of {times} more chats reaches the server at once",
            not late,
            "at the server after "
            + ", ".join("never" if d is None else f"{d:.2f}" for d, _ in delays)
            + " s; answered after "
            + ", ".join(f"{t:.1f}" for _, t in delays)
            + " s; "
            f"the server's /health answered within {slowest:.2f} s throughout (a message late while it "
            "answers at once waited in Open WebUI, not in the server)",
        )

    def stop(self, page) -> None:
        self.new_chat(page)
        self.control(page, "max_tokens", 4096)
        cancelled = self.health()["cancelled"]
        index = page.locator("#response-content-container").count()
        self.send(page, LONG, wait=False)
        response = page.locator("#response-content-container").nth(index)
        deadline = time.monotonic() + 120
        while len(response.inner_text()) < 40 and time.monotonic() < deadline:
            page.wait_for_timeout(100)
        page.get_by_role("button", name="Stop", exact=True).click()
        page.wait_for_timeout(3000)
        at_stop = response.inner_text()
        page.wait_for_timeout(3000)
        later = response.inner_text()
        self.shot(page, "stopped")
        now = self.health()["cancelled"]
        self.step(
            "Stop cuts the stream",
            later == at_stop and len(later) < 4096 and now > cancelled,
            f"{len(at_stop)} characters when stopped, {len(later)} three seconds later (of up to 4096 tokens); "
            f"the server cancelled {now - cancelled} request(s)",
        )

    def knobs(self, page) -> None:
        messages = [{"role": "user", "content": LONG}]
        self.new_chat(page)
        self.control(page, "max_tokens", 3)
        text, _ = self.send(page, FIRST)
        self.step("max tokens honoured", text == FIRST_ANSWER[:3], f"max_tokens 3: {FIRST!r} -> {text!r}")

        self.new_chat(page)  # (the settings are the chat's: a new chat starts from the defaults)
        self.control(page, "max_tokens", 32)
        self.control(page, "Seed", SEED)
        base = {"seed": SEED, "max_tokens": 32}
        text, _ = self.send(page, LONG)
        plain = self.direct(messages, base)
        self.step("seed honoured", text == plain, f"seed {SEED}: the page shows {text!r}, the server answers {plain!r}")
        for answers, (name, value, key) in enumerate(KNOBS, start=2):
            self.control(page, name, value)
            shown = self.regenerate(page, answers)
            self.shot(page, f"{key}-{value}")
            expected = self.direct(messages, {**base, key: value})
            carried = [option(r["body"], key) for r in self.chat_requests(LONG)]
            self.step(
                f"{name} honoured",
                shown == expected != plain and value in carried,
                f"{key} {value}: the page shows {shown!r}, the server answers the same request {expected!r}, "
                f"and {plain!r} without it; Open WebUI sent {key} = {carried[-1] if carried else None}",
            )
            self.control(page, name, None)


class HealthProbe:
    """Asks the server's ``/health`` four times a second, in a thread, until ``stop``: whether the server
    answers at once throughout (its event loop free) while the browser's requests go to it."""

    def __init__(self, server: str):
        self.url, self.slowest, self.done = server + "/health", 0.0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.done.wait(0.25):
            started = time.monotonic()
            try:
                urllib.request.urlopen(self.url, timeout=120).read()
            except OSError:
                pass
            self.slowest = max(self.slowest, time.monotonic() - started)

    def stop(self) -> float:
        """The longest ``/health`` took, in seconds."""
        self.done.set()
        self.thread.join()
        return self.slowest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connection", choices=["ollama", "openai"], required=True)
    parser.add_argument("--webui", required=True, help="Open WebUI's URL")
    parser.add_argument("--server", required=True, help="the mlx-dgemma server's URL")
    parser.add_argument("--server-log", required=True, help="the server's log (written with --log-level debug)")
    parser.add_argument("--shots", required=True, help="folder for the screenshots")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument(
        "--repeat",
        type=int,
        default=0,
        help="this many more two-message chats, timed from Enter to the server (the stall check)",
    )
    sys.exit(0 if Run(parser.parse_args()).run() else 1)


if __name__ == "__main__":
    main()
