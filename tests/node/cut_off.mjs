// A worker of the example's library whose "node.hold" jobs end together when told ("release"),
// while the test cuts it off from the API. Prints "ready", each line it logs as "log: …",
// then its counts as JSON when told to stop.
import { Worker } from "../../examples/node-worker/jobtier-worker.mjs";
import { runUntilStopped } from "./harness.mjs";

const [url, key] = process.argv.slice(2);
let release;
const together = new Promise((resolve) => (release = resolve)); // every job ends at once
const tasks = {
  "node.hold": { max_attempts: 3, handler: async (payload) => { await together; return payload; } },
};
const log = { error: (m) => console.log(`log: ${m}`), info: () => {} };
const worker = new Worker({ url, key, worker: "node-cut", concurrency: 10, wait: 1, tasks, log });
await runUntilStopped(worker, (line) => {
  if (line === "release") release();
});
