// An example jobtier worker in Node: `node worker.mjs`, configured from the environment:
//
//   JOBTIER_URL         the API (default http://127.0.0.1:8000)
//   WORKER_KEY          one of the API's JOBTIER_WORKER_KEYS
//   WORKER_ID           its name (default node-<host>-<pid>)
//   WORKER_CONCURRENCY  jobs at once (default 10)
//
// It prints one line "ready" once its tasks are in the catalogue, and a JSON line of its
// counts when it stops (SIGTERM or SIGINT: it claims nothing more, its running jobs finish).

import { NonRetryable, RateLimited, Worker } from "./jobtier-worker.mjs";

const sleep = (ms, signal) =>
  new Promise((resolve, reject) => {
    const aborted = () => {
      clearTimeout(timer);
      reject(signal.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", aborted); // one listener per sleep, not one more each
      resolve();
    }, ms);
    signal?.addEventListener("abort", aborted, { once: true });
  });

const limitedOnce = new Set(); // node.fail's jobs told to wait once

const tasks = {
  // a task with a payload schema: the API refuses a submit that does not fit it (422)
  "node.add": {
    payload_schema: {
      type: "object",
      properties: { a: { type: "number" }, b: { type: "number" } },
      required: ["a", "b"],
    },
    handler: async ({ a, b }, ctx) => {
      ctx.log(`adding ${a} and ${b}`);
      return { sum: a + b, by: "node" };
    },
  },
  "node.echo": async (payload) => payload,
  // runs past its timeout: the attempt fails with a TimeoutError (and ctx.signal aborts)
  "node.slow": {
    timeout: 0.2,
    max_attempts: 1,
    handler: async ({ ms = 5000 }, ctx) => sleep(ms, ctx.signal),
  },
  // reports progress while it works; stops when a cancel is asked (ctx.signal)
  "node.steps": async ({ steps = 3, ms = 10 }, ctx) => {
    for (let i = 1; i <= steps; i++) {
      await sleep(ms, ctx.signal);
      ctx.progress({ done: i, of: steps });
    }
    return { steps };
  },
  // fails: a plain Error is retried by the task's backoff, NonRetryable is dead-lettered;
  // RateLimited gives the attempt back (here the first time a job is met): it runs again
  // without its attempt counted, and its queue starts no job for the 50 ms meanwhile
  "node.fail": {
    max_attempts: 2,
    backoff: { base: 0.05, factor: 1, cap: 0.05, jitter: 0 },
    handler: async ({ fatal = false, limited = false }, ctx) => {
      if (fatal) throw new NonRetryable("this one cannot succeed");
      if (limited && !limitedOnce.has(ctx.job.id)) {
        limitedOnce.add(ctx.job.id);
        throw new RateLimited("the partner answered 429", 0.05, { blockQueue: true });
      }
      if (limited) return { limited: "once" };
      throw new Error("failed on purpose");
    },
  },
};

const worker = new Worker({
  url: process.env.JOBTIER_URL ?? "http://127.0.0.1:8000",
  key: process.env.WORKER_KEY,
  worker: process.env.WORKER_ID,
  concurrency: Number(process.env.WORKER_CONCURRENCY ?? 10),
  tasks,
});

for (const signal of ["SIGTERM", "SIGINT"]) {
  process.on(signal, () => worker.stop());
}

await worker.register();
console.log("ready");
await worker.run();
console.log(JSON.stringify(worker.stats));
