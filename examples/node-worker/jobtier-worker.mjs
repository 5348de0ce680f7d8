// A jobtier HTTP worker for Node 18+, with nothing but the standard library (global fetch).
//
// JobtierClient speaks the protocol (docs/http-workers.md): one method per /v1/worker route,
// each answer about a job fenced by its lease_version. Worker runs tasks with it: a claim
// loop (a long poll for as many jobs as it has free slots), a heartbeat per running job every
// third of the lease (its answer carries cancel requests), and the job's outcome at its end.

import { hostname } from "node:os";

// Results sent in one request at most (their JSON), well under the API's default request
// limit (JOBTIER_MAX_REQUEST_BYTES, 8 MiB); a batch refused as too large is sent one by one.
const RESULTS_BYTES = 4 * 1024 * 1024;

export class LeaseLost extends Error {
  // the API refused an answer about a job (409): its lease is not ours any more, so the
  // job moved on (another worker may be running it) and whatever we say of it is dropped.
  // `now`: what the job is now, as the API says ({state, attempt, worker})
  constructor(jobId, detail, now = {}) {
    super(detail);
    this.name = "LeaseLost";
    this.jobId = jobId;
    this.state = now.state ?? null;
    this.attempt = now.attempt ?? null;
    this.worker = now.worker ?? null;
  }
}

// Whether a request's failure may pass if it is sent again: no answer (the API unreachable,
// a connection dropped: fetch throws), an answer that is not JSON (a proxy's error page), a
// 5xx or a 429. A refusal of the request itself (another 4xx) or of the job (409) stays.
export function mayPass(err) {
  if (err instanceof LeaseLost) return false;
  return err.status === undefined || err.status >= 500 || err.status === 429;
}

// Throw it from a task for a failure that no retry can mend: the job is dead-lettered.
export class NonRetryable extends Error {
  constructor(message) {
    super(message);
    this.name = "NonRetryable";
  }
}

// Throw it from a task that could not run the job now (a partner's 429, a rate limit of
// your own): the attempt is given back, not counted, and the job runs again after
// `retryAfter` seconds (else the task's backoff).
export class RateLimited extends Error {
  // blockQueue (with a retryAfter): the job's queue also starts no job for retryAfter
  // seconds, on every worker, as after a Python task's RateLimited (an API from before
  // block_queue refuses it: upgrade the API first)
  constructor(message, retryAfter = null, { blockQueue = false } = {}) {
    if (retryAfter !== null && !(Number.isFinite(retryAfter) && retryAfter >= 0)) {
      throw new RangeError(`retryAfter must be a number of seconds >= 0, or null: ${retryAfter}`);
    }
    if (blockQueue && retryAfter === null) {
      throw new RangeError("blockQueue needs a retryAfter: the seconds the queue waits");
    }
    super(message);
    this.name = "RateLimited";
    this.retryAfter = retryAfter;
    this.blockQueue = Boolean(blockQueue);
  }
}

export class JobtierClient {
  constructor({ url, key, worker }) {
    this.url = url.replace(/\/$/, "");
    this.key = key;
    this.worker = worker;
  }

  // traceparent: the job's trace context (the claim's `traceparent`), for a call about one
  // job: the API's span of it joins the trace of the job's submit
  async request(method, path, body, signal, traceparent = null) {
    const headers = { authorization: `Bearer ${this.key}`, "content-type": "application/json" };
    if (traceparent) headers.traceparent = traceparent;
    const response = await fetch(this.url + path, {
      method,
      headers,
      body: JSON.stringify(body),
      signal,
    });
    let answer;
    try {
      answer = await response.json();
    } catch {
      // not the API's answer (a proxy's error page): its status says whether to try again
      // (mayPass); a 2xx whose body was cut short has none, and is sent again
      const error = new Error(`${method} ${path}: ${response.status}, an answer that is not JSON`);
      if (!response.ok) error.status = response.status;
      throw error;
    }
    const problem = typeof answer.type === "string" ? answer.type.split(":").pop() : null;
    if (response.status === 409 && problem !== "queue-limited") {
      throw new LeaseLost(answer.job_id, answer.detail, answer);
    }
    if (!response.ok) {
      const error = new Error(`${method} ${path}: ${response.status} ${answer.detail}`);
      error.status = response.status;
      error.problem = problem; // e.g. "queue-limited": every queue claimed is limited
      throw error;
    }
    return answer;
  }

  // tasks: [{type, queue, max_attempts, backoff, timeout, payload_schema}]
  register(tasks) {
    return this.request("PUT", "/v1/worker/tasks", { worker: this.worker, tasks });
  }

  claim({ types, queues, count, wait, running }, signal) {
    const body = { worker: this.worker, types, queues, count, wait, running };
    return this.request("POST", "/v1/worker/claim", body, signal);
  }

  // no longer listed as live (at once, rather than a minute after the last claim)
  leave() {
    return this.request("POST", "/v1/worker/leave", { worker: this.worker });
  }

  job(job, action, extra = {}) {
    const body = { worker: this.worker, lease_version: job.lease_version, ...extra };
    const path = `/v1/worker/jobs/${job.id}/${action}`;
    return this.request("POST", path, body, undefined, job.traceparent);
  }

  heartbeat(job, progress = null) {
    return this.job(job, "heartbeat", { progress });
  }

  progress(job, progress) {
    return this.job(job, "progress", { progress });
  }

  logs(job, lines) {
    return this.job(job, "logs", { attempt: job.attempt, lines });
  }

  complete(job, result = null) {
    return this.job(job, "complete", { result });
  }

  // several jobs' results in one request: [{id, lease_version, result}] -> one answer each,
  // in order: {id, status: 200 | 409 | 404, state, detail}
  completeMany(jobs) {
    return this.request("POST", "/v1/worker/complete", { worker: this.worker, jobs });
  }

  // held: the attempt is given back, not counted (RateLimited); blockQueue: with held and
  // retryIn, the job's queue starts no job for retryIn seconds, on every worker
  fail(job, error, { retryable = true, retryIn = null, held = false, blockQueue = false } = {}) {
    const body = {
      error: {
        type: error.name || "Error",
        message: String(error.message ?? error),
        traceback: error.stack || null,
      },
      retryable,
      retry_in: retryIn,
      // only when true: an API before "held" (or "block_queue") refuses a field it does not
      // know (a 422)
      ...(held ? { held: true } : {}),
      ...(blockQueue ? { block_queue: true } : {}),
    };
    return this.job(job, "fail", body);
  }

  stopped(job) {
    return this.job(job, "stopped");
  }
}

// What a task gets besides its payload: its job, a signal aborted on a cancel request (or a
// lost lease), and ways to report progress and log lines.
class JobContext {
  constructor(worker, job) {
    this.job = job;
    // the outcomes of the jobs it waited for, in order ({id, state, result, error, ...});
    // empty for a job that waited for none
    this.dependencies = job.dependencies ?? [];
    this.controller = new AbortController();
    this.signal = this.controller.signal;
    this.worker = worker;
    this.lost = false;
    this.cancelled = false;
    this.pendingProgress = undefined;
    this.progressSent = null; // the progress report in flight, if any
    this.pendingLines = [];
    this.logsSent = null; // the log lines in flight, if any
  }

  progress(value = null) {
    this.pendingProgress = value; // sent at once, merged with others in flight
    this.worker.sendProgress(this);
  }

  log(...parts) {
    const line = parts.map((p) => (typeof p === "string" ? p : JSON.stringify(p))).join(" ");
    this.pendingLines.push(line); // sent at once, with the others logged meanwhile
    this.worker.sendLogs(this);
  }
}

export class Worker {
  // tasks: {type: handler(payload, ctx) | {handler, queue, max_attempts, backoff, timeout,
  // payload_schema}}
  constructor({ url, key, worker, tasks, queues, concurrency = 10, wait = 20, log = console }) {
    // the host in the default name: in containers every worker's pid may be 1
    const name = worker ?? `node-${hostname()}-${process.pid}`;
    this.client = new JobtierClient({ url, key, worker: name });
    this.tasks = {};
    for (const [type, spec] of Object.entries(tasks)) {
      this.tasks[type] = typeof spec === "function" ? { handler: spec } : spec;
    }
    this.queues = queues ?? [...new Set(Object.values(this.tasks).map((t) => t.queue ?? "default"))];
    this.concurrency = concurrency;
    this.wait = wait;
    this.log = log;
    this.running = new Map(); // job id -> JobContext
    this.reporting = new Set(); // per job started: done once its outcome is sent
    this.stopping = false;
    this.claimAbort = new AbortController();
    this.slotFree = null; // resolves when a running job ends
    this.stats = { succeeded: 0, failed: 0, held: 0, cancelled: 0, lost: 0, unsent: 0 };
    // results waiting for the next batch: one request carries all that ended while the
    // previous one was in flight (a request per job would make the API the bottleneck)
    this.outbox = [];
    this.sending = false;
    this.limitedSaid = ""; // the limited queues last logged (a claim answer names them)
    this.retryWake = null; // ends the wait before a failed claim is tried again
  }

  async register() {
    const ads = Object.entries(this.tasks).map(([type, t]) => ({
      type,
      queue: t.queue ?? "default",
      max_attempts: t.max_attempts ?? 3,
      backoff: t.backoff ?? null,
      timeout: t.timeout ?? null,
      payload_schema: t.payload_schema ?? null,
    }));
    try {
      await this.client.register(ads);
    } catch (err) {
      // a 409: a live Python worker advertises one of these types, and its entry is kept
      // (docs/http-workers.md); the worker still claims them
      if (!(err instanceof LeaseLost)) throw err;
      this.log.error(`tasks not advertised: ${err.message}`);
    }
  }

  // Claim and run jobs until stop(); then wait for the running ones to end.
  async run() {
    await this.register();
    // an advert counts for JOBTIER_TASK_CATALOG_TTL: say it again now and then
    const advert = setInterval(() => this.register().catch(() => {}), 60_000);
    let backoff = 100;
    try {
      while (!this.stopping) {
        const free = this.concurrency - this.running.size;
        if (free <= 0) {
          await new Promise((resolve) => (this.slotFree = resolve));
          continue;
        }
        let answer;
        try {
          answer = await this.client.claim(
            {
              types: Object.keys(this.tasks),
              queues: this.queues,
              count: free,
              wait: this.wait,
              running: this.running.size,
            },
            this.claimAbort.signal,
          );
          backoff = 100;
        } catch (err) {
          if (this.stopping) break;
          // every queue it serves is limited (their permits are for Python workers): asked
          // again a minute on, in case a limit is lifted
          const wait = err.problem === "queue-limited" ? 60_000 : backoff;
          this.log.error(`claim failed: ${err.message}; retrying in ${wait} ms`);
          await new Promise((resolve) => {
            const timer = setTimeout(resolve, wait);
            this.retryWake = () => {
              clearTimeout(timer); // (a pending timer would keep a stopped process up)
              resolve();
            };
          });
          this.retryWake = null;
          backoff = Math.min(backoff * 2, 5000);
          continue;
        }
        const limited = (answer.limited ?? []).join(", ");
        if (limited && limited !== this.limitedSaid) {
          this.log.error(
            `queues ${limited} are limited: their permits are for Python workers, so this ` +
              "worker gets none of their jobs",
          );
        }
        this.limitedSaid = limited;
        for (const job of answer.jobs) {
          this.start(job, answer.lease_seconds);
        }
      }
    } finally {
      clearInterval(advert);
    }
    while (this.reporting.size > 0) {
      await Promise.allSettled([...this.reporting]); // the running jobs, and their outcomes
    }
    // (an API before the route answers 404: the worker then drops out a minute on)
    await this.client.leave().catch((err) => this.log.error(`leave failed: ${err.message}`));
  }

  // Claim nothing more; jobs running finish (call giveBack() to hand them back instead).
  stop() {
    this.stopping = true;
    this.claimAbort.abort();
    this.wakeClaimLoop();
    this.retryWake?.(); // a claim's retry waiting out its back-off
  }

  // Hand every running job back to its queue now (a shutdown that cannot wait for them).
  async giveBack() {
    await Promise.all(
      [...this.running.values()].map((ctx) => {
        ctx.lost = true; // its outcome is no longer ours to report
        ctx.controller.abort();
        return this.client.stopped(ctx.job).catch(() => {});
      }),
    );
  }

  wakeClaimLoop() {
    const resolve = this.slotFree;
    this.slotFree = null;
    if (resolve) resolve();
  }

  start(job, leaseSeconds) {
    const ctx = new JobContext(this, job);
    ctx.leaseMs = leaseSeconds * 1000;
    ctx.leaseEnds = Date.now() + ctx.leaseMs; // moved on by each heartbeat answered
    this.running.set(job.id, ctx);
    const beat = setInterval(() => this.beat(ctx), (leaseSeconds * 1000) / 3);
    // the slot frees as the task ends, ahead of its outcome's request (as a Python worker's
    // does): the next claim and the outcome travel side by side
    ctx.release = () => {
      clearInterval(beat);
      if (this.running.delete(job.id)) this.wakeClaimLoop();
    };
    const done = this.execute(ctx)
      .catch((err) => this.log.error(`job ${job.id}: ${err.message}`))
      .finally(() => {
        ctx.release();
        this.reporting.delete(done);
      });
    this.reporting.add(done);
  }

  async execute(ctx) {
    const { job } = ctx;
    const task = this.tasks[job.type];
    let outcome;
    let timer;
    try {
      let run = task.handler(job.payload, ctx);
      // the job's own timeout (given at its submit), else the task's advertised one:
      // ctx.signal aborts, and the attempt fails (retried)
      const limit = job.timeout ?? task.timeout;
      if (limit) {
        const late = new Promise((_, reject) => {
          timer = setTimeout(() => {
            const err = new Error(`the task ran past its timeout of ${limit} s`);
            err.name = "TimeoutError";
            ctx.controller.abort(err);
            reject(err);
          }, limit * 1000);
        });
        run = Promise.race([run, late]);
      }
      outcome = { ok: true, result: (await run) ?? null };
    } catch (err) {
      outcome = { ok: false, err };
    } finally {
      clearTimeout(timer);
    }
    await this.reportsSent(ctx);
    ctx.release();
    if (ctx.lost) {
      this.stats.lost += 1;
      return; // the job moved on: anything we said would be refused (409)
    }
    // sent again while its failure may pass, until the lease would have lapsed (its last
    // heartbeat answered, plus a lease)
    const until = ctx.leaseEnds;
    const what = `job ${job.id}`;
    try {
      if (ctx.cancelled) {
        await this.withRetries(what, until, () => this.client.stopped(job));
        this.stats.cancelled += 1;
      } else if (outcome.ok) {
        await this.completeBatched(job, outcome.result, until);
        this.stats.succeeded += 1;
      } else {
        const err = outcome.err instanceof Error ? outcome.err : new Error(String(outcome.err));
        const held = err instanceof RateLimited; // the attempt given back, not failed
        const how = held
          ? { held, retryIn: err.retryAfter, blockQueue: err.blockQueue }
          : { retryable: !(err instanceof NonRetryable) };
        await this.withRetries(what, until, () => this.client.fail(job, err, how));
        this.stats[held ? "held" : "failed"] += 1;
      }
    } catch (err) {
      if (err instanceof LeaseLost) {
        this.stats.lost += 1;
        this.log.error(`job ${job.id}: outcome refused, ${err.message}`);
        return;
      }
      let failure = null;
      if (err.name === "ResultNotJSON") {
        failure = err;
      } else if (err.status === 413 && outcome.ok && !ctx.cancelled) {
        // its result is over the API's limit: the job fails for good, saying so (run again,
        // it would make the same result), rather than waiting out its lease to run again
        failure = new NonRetryable(`the task's result was refused: ${err.message}`);
        failure.name = "ResultTooLarge";
      }
      if (failure !== null) {
        try {
          const send = () => this.client.fail(job, failure, { retryable: false });
          await this.withRetries(what, until, send);
          this.stats.failed += 1;
          return;
        } catch (again) {
          if (again instanceof LeaseLost) {
            this.stats.lost += 1;
            this.log.error(`job ${job.id}: outcome refused, ${again.message}`);
            return;
          }
          err = again;
        }
      }
      // given up: refused as a request (another 4xx), or still failing when the lease would
      // lapse; the job runs again once its lease has lapsed
      this.stats.unsent += 1;
      const when = "it runs again once its lease lapses";
      this.log.error(`job ${job.id}: outcome not sent, ${err.message}; ${when}`);
    }
  }

  completeBatched(job, result, until) {
    return new Promise((resolve, reject) => {
      this.outbox.push({ job, result, until, resolve, reject });
      if (!this.sending) this.sendResults();
    });
  }

  // An outcome whose request failed in a way that may pass (mayPass) is sent again, with
  // back-off, until `until` (its job's lease would have lapsed by then): given up at once,
  // the job would wait out its lease and run again. A resend whose first try was taken (its
  // reply lost) is refused, saying the job is already as it made it (doneByUs).
  async withRetries(what, until, send) {
    let wait = 100;
    for (;;) {
      try {
        return await send();
      } catch (err) {
        if (!mayPass(err) || Date.now() + wait >= until) throw err;
        this.log.error(`${what}: ${err.message}; sending again in ${wait} ms`);
        await new Promise((resolve) => setTimeout(resolve, wait));
        wait = Math.min(wait * 2, 5000);
      }
    }
  }

  // Did an earlier send of this job's result succeed it (a 409 whose job is succeeded under
  // this worker, at this attempt)? Then the job is done, not lost.
  doneByUs(now, job) {
    return (
      now.state === "succeeded" &&
      now.worker === `http:${this.client.worker}` &&
      now.attempt === job.attempt
    );
  }

  async sendResults() {
    this.sending = true;
    try {
      while (this.outbox.length > 0) {
        const batch = this.takeBatch();
        const items = batch.map((b) => b.item);
        if (batch.length === 1 && batch[0].unencodable) {
          batch[0].reject(batch[0].unencodable); // its task's failure, not the others'
          continue;
        }
        try {
          const until = Math.min(...batch.map((b) => b.until));
          const what = `results of ${batch.length} job(s)`;
          const answer = await this.withRetries(what, until, () => this.client.completeMany(items));
          answer.jobs.forEach((r, i) =>
            r.status === 200 || this.doneByUs(r, batch[i].job)
              ? batch[i].resolve(r)
              : batch[i].reject(new LeaseLost(r.id, r.detail, r)),
          );
          for (const b of batch.slice(answer.jobs.length)) {
            b.reject(new Error(`job ${b.job.id}: the batch's answer says nothing of it`));
          }
        } catch (err) {
          if (batch.length > 1 && err.status === 413) {
            // refused as a whole (one result over the server's limit, or the body over its
            // request limit): each alone, so that one result cannot cost the others theirs
            await Promise.all(batch.map((b) => this.completeAlone(b)));
          } else {
            for (const b of batch) b.reject(err); // their leases expire: the jobs run again
          }
        }
      }
    } finally {
      this.sending = false;
    }
  }

  // The outbox's first results, up to 1,000 and about RESULTS_BYTES of JSON (at least one):
  // a request under the API's JOBTIER_MAX_REQUEST_BYTES (8 MiB by default) however large the
  // results, each up to JOBTIER_MAX_RESULT_BYTES (1 MiB).
  takeBatch() {
    let size = 0;
    let n = 0;
    while (n < this.outbox.length && n < 1000) {
      const b = this.outbox[n];
      b.item ??= { id: b.job.id, lease_version: b.job.lease_version, result: b.result };
      if (b.size === undefined) {
        try {
          b.size = Buffer.byteLength(JSON.stringify(b.item));
        } catch (err) {
          // not JSON (a BigInt, a cycle): its job fails, alone
          const bad = new NonRetryable(`the task's result cannot be sent as JSON: ${err.message}`);
          bad.name = "ResultNotJSON";
          bad.status = 400;
          b.unencodable = bad;
          b.size = 0;
        }
      }
      if (b.unencodable) return this.outbox.splice(0, n || 1); // alone, or the ones before it
      if (n > 0 && size + b.size > RESULTS_BYTES) break;
      size += b.size;
      n += 1;
    }
    return this.outbox.splice(0, n);
  }

  async completeAlone(b) {
    try {
      const send = () => this.client.complete(b.job, b.result);
      b.resolve(await this.withRetries(`job ${b.job.id}`, b.until, send));
    } catch (err) {
      if (err instanceof LeaseLost && this.doneByUs(err, b.job)) b.resolve(err);
      else b.reject(err);
    }
  }

  async beat(ctx) {
    try {
      const answer = await this.client.heartbeat(ctx.job);
      this.onAnswer(ctx, answer);
    } catch (err) {
      this.onBeatError(ctx, err);
    }
  }

  // One progress report and one batch of log lines in flight per job, the latest progress
  // winning; the job's outcome waits for them (reportsSent), else it could overtake them
  // and they be refused (the job would have ended).
  sendProgress(ctx) {
    if (ctx.progressSent) return;
    const value = ctx.pendingProgress;
    ctx.pendingProgress = undefined;
    ctx.progressSent = this.client
      .progress(ctx.job, value)
      .then((answer) => this.onAnswer(ctx, answer))
      .catch((err) => this.onBeatError(ctx, err, "progress"))
      .finally(() => {
        ctx.progressSent = null;
        if (ctx.pendingProgress !== undefined) this.sendProgress(ctx);
      });
  }

  sendLogs(ctx) {
    if (ctx.logsSent) return;
    const lines = ctx.pendingLines.splice(0, 200);
    ctx.logsSent = this.client
      .logs(ctx.job, lines)
      .catch((err) => this.onBeatError(ctx, err, "log lines"))
      .finally(() => {
        ctx.logsSent = null;
        if (ctx.pendingLines.length > 0) this.sendLogs(ctx);
      });
  }

  async reportsSent(ctx) {
    while (ctx.progressSent || ctx.logsSent) {
      await Promise.all([ctx.progressSent, ctx.logsSent]);
    }
  }

  onAnswer(ctx, answer) {
    ctx.leaseEnds = Date.now() + ctx.leaseMs; // (about: it was extended just before we heard)
    if (answer.cancel_requested && !ctx.cancelled) {
      ctx.cancelled = true; // the task sees ctx.signal aborted; we then say "stopped"
      ctx.controller.abort();
    }
  }

  onBeatError(ctx, err, what = "heartbeat") {
    if (err instanceof LeaseLost) {
      ctx.lost = true;
      ctx.controller.abort();
    } else {
      this.log.error(`job ${ctx.job.id}: ${what} failed: ${err.message}`);
    }
  }
}
