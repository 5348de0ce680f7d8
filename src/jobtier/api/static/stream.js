// stream.js: Server-Sent Events read with fetch(), so that the admin key goes in a header
// (EventSource cannot send one), with reconnection.

/**
 * One event stream that stays open: `onEvent(type, data)` for each event; `onState(state,
 * reason)` with "connecting", "live" (the first event arrived), "reconnecting" (with why);
 * `onAuth(message)` when the key is refused (the feed stops). A connection that dies without
 * an error reaching the page (a sleeping laptop, a proxy dropping idle TCP) is noticed after
 * `stallSeconds` without a byte, and replaced. Retries back off exponentially, with jitter,
 * so many open pages do not reconnect in step.
 */
class Feed {
  constructor(url, { onEvent, onState = () => {}, onAuth = () => {}, stallSeconds = 45, maxBackoff = 30 }) {
    Object.assign(this, { url, onEvent, onState, onAuth, stallSeconds, maxBackoff });
    this.generation = 0; // bumped by start/stop: an older loop sees it and ends
    this.attempt = 0;
    this.controller = null;
    this.timer = null;
    this.lastEventAt = 0;
  }

  start() {
    this.stop();
    this.run(this.generation);
  }

  stop() {
    this.generation++;
    clearTimeout(this.timer);
    this.timer = null;
    if (this.controller) this.controller.abort();
    this.controller = null;
  }

  /** Reconnect now (the banner's "Retry now"). */
  retryNow() {
    this.attempt = 0;
    this.start();
  }

  async run(mine) {
    const key = sessionStorage.getItem(KEY_STORE);
    const ctrl = (this.controller = new AbortController());
    this.onState(this.attempt ? "reconnecting" : "connecting", "");
    let response;
    try {
      response = await fetch(this.url, {
        headers: { authorization: `Bearer ${key}`, accept: "text/event-stream" },
        cache: "no-store",
        signal: ctrl.signal,
      });
    } catch {
      if (this.generation === mine) this.later(mine, "network error");
      return;
    }
    if (this.generation !== mine) return;
    if (response.status === 401 || response.status === 403) {
      let detail = "";
      try { detail = (await response.json()).detail || ""; } catch { /* no body */ }
      this.stop();
      this.onAuth(keyMessage(response.status, detail));
      return;
    }
    if (!response.ok || !response.body) {
      let detail = "";
      try { detail = (await response.json()).detail || ""; } catch { /* no body */ }
      return this.later(mine, `HTTP ${response.status}${detail ? ": " + detail : ""}`);
    }
    let heard = Date.now();
    const watchdog = setInterval(() => {
      if (Date.now() - heard > this.stallSeconds * 1000) ctrl.abort();
    }, 1000);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let reason = "the server closed the stream";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done || this.generation !== mine) break;
        heard = Date.now();
        // lines end in \n, \r\n or \r; an event ends at a blank line. A trailing \r waits
        // for the next chunk: it may be half of a \r\n.
        buffer = (buffer + value).replace(/\r\n|\r(?!$)/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          this.dispatch(block);
          if (this.generation !== mine) break;
        }
      }
    } catch {
      reason = ctrl.signal.aborted ? `no data for ${this.stallSeconds} s` : "network error";
    } finally {
      clearInterval(watchdog);
    }
    if (this.generation === mine) this.later(mine, reason);
  }

  /** One event block: `event:` names it, `data:` lines (joined by \n) carry JSON. */
  dispatch(block) {
    let type = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (!line || line.startsWith(":")) continue; // comments keep proxies awake
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") type = value;
      else if (field === "data") data.push(value);
    }
    if (!data.length) return;
    let parsed;
    try {
      parsed = JSON.parse(data.join("\n"));
    } catch {
      return; // a malformed event is skipped
    }
    this.attempt = 0;
    this.lastEventAt = Date.now();
    this.onState("live", "");
    this.onEvent(type, parsed);
  }

  later(mine, reason) {
    const delay = Math.min(this.maxBackoff, 2 ** this.attempt) * (0.75 + Math.random() * 0.5);
    this.attempt++;
    const until = Date.now() + delay * 1000;
    const tick = () => {
      if (this.generation !== mine) return;
      const left = Math.max(0, Math.ceil((until - Date.now()) / 1000));
      this.onState("reconnecting", reason, left);
      if (left > 0) this.timer = setTimeout(tick, Math.min(1000, until - Date.now()));
      else this.run(mine);
    };
    tick();
  }
}
