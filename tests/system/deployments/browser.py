"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol: open a page, wait until its rendered
text holds what we look for, read the DOM, save a screenshot. The Prefect UI is a single-page app that fills the
page from API calls, so "wait until the text appears" is the only reliable readiness signal."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
from websockets.sync.client import connect

# Offline, as root, no GPU: nothing may reach the network or need a sandbox/user namespace.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--disable-breakpad",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
]


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One Chromium process with one page; use as a context manager."""

    def __init__(self, user_data_dir: Path, width: int = 1440, height: int = 1100):
        self.user_data_dir, self.width, self.height = Path(user_data_dir), width, height
        self._next_id = 0

    def __enter__(self) -> Browser:
        self.user_data_dir.mkdir(parents=True, exist_ok=True)
        (self.user_data_dir / "DevToolsActivePort").unlink(missing_ok=True)  # a reused profile keeps the old port
        self.log = open(self.user_data_dir.parent / "chromium.log", "ab")
        self.proc = subprocess.Popen(
            [
                chromium_path(),
                *CHROMIUM_FLAGS,
                f"--user-data-dir={self.user_data_dir}",
                f"--window-size={self.width},{self.height}",
                "about:blank",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        port_file = self.user_data_dir / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"chromium did not start (log: {self.log.name})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json() if t["type"] == "page"]
        self.ws = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
        self.call("Page.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=self.width,
            height=self.height,
            deviceScaleFactor=1,
            mobile=False,
        )
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        # /usr/bin/chromium is a shell wrapper: the browser and its helpers are in the wrapper's process group.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(10)
                time.sleep(0.5)  # the browser's children leave after the wrapper
            except subprocess.TimeoutExpired:
                continue
        self.log.close()

    def call(self, method: str, **params):
        self._next_id += 1
        self.ws.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:  # events arrive interleaved with replies
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self._next_id:
                if "error" in msg:
                    raise AssertionError(f"CDP {method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, expression: str):
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise AssertionError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def text(self) -> str:
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def open(self, url: str, wait_for: list[str], timeout: float = 90.0) -> str:
        """Navigate and wait until the page's visible text contains every string of `wait_for`; returns the text."""
        # Mark the current document: until the mark is gone, the text read is still the old page's.
        self.evaluate("window.__previous_page = true")
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while self.evaluate("window.__previous_page === true"):
            assert time.monotonic() < deadline, f"{url}: navigation did not happen"
            time.sleep(0.1)
        text = ""
        while time.monotonic() < deadline:
            text = self.text()
            if all(w in text for w in wait_for):
                time.sleep(1.0)  # let late requests (charts, markdown images) finish before a screenshot
                return self.text()
            time.sleep(0.5)
        missing = [w for w in wait_for if w not in text]
        raise AssertionError(f"{url}: {missing} never appeared; page text was:\n{text[:3000]}")

    def click_text(self, text: str, selector: str = "button, a, [role=tab]") -> None:
        """Click the first element matching `selector` whose visible text is `text` (a tab, a button)."""
        found = self.evaluate(
            f"(() => {{ const el = [...document.querySelectorAll({json.dumps(selector)})]"
            f".find(e => e.innerText && e.innerText.trim() === {json.dumps(text)});"
            " if (!el) return false; el.click(); return true; })()"
        )
        assert found, f"no {selector} with text {text!r} on the page"

    def dom(self) -> str:
        return self.evaluate("document.documentElement.outerHTML") or ""

    def screenshot(self, path: Path, full_page: bool = True, height: int | None = None) -> Path:
        """The page (up to 6000 px), the viewport, or the viewport's top `height` pixels."""
        params = {"format": "png"}
        if height:
            params["clip"] = {"x": 0, "y": 0, "width": self.width, "height": min(height, self.height), "scale": 1}
        elif full_page:
            params["captureBeyondViewport"] = True
            h = self.evaluate("Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)") or 0
            params["clip"] = {"x": 0, "y": 0, "width": self.width, "height": min(max(h, self.height), 6000), "scale": 1}
        data = self.call("Page.captureScreenshot", **params)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
