// A worker of the example's library whose tasks end together with results that do not fit
// one request: "node.mid" results each under the API's result limit but together over its
// request limit, one "node.big" result over the result limit, and one "node.bigint" result
// JSON cannot encode. Prints "ready", then its
// counts as JSON when stdin closes.
import { Worker } from "../../examples/node-worker/jobtier-worker.mjs";
import { runUntilStopped } from "./harness.mjs";

const [url, key, midBytes, bigBytes] = process.argv.slice(2);
let release;
const together = new Promise((resolve) => (release = resolve)); // every job ends at once
const tasks = {
  "node.mid": { max_attempts: 2, handler: async () => { await together; return "m".repeat(Number(midBytes)); } },
  "node.big": { max_attempts: 2, handler: async () => { await together; return "b".repeat(Number(bigBytes)); } },
  "node.bigint": { max_attempts: 2, handler: async () => { await together; return { n: 10n }; } },
};
const worker = new Worker({ url, key, worker: "node-big", concurrency: 50, wait: 1, tasks, log: { error() {}, info() {} } });
await runUntilStopped(worker, (line) => {
  if (line === "release") release();
});
