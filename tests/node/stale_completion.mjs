// Claims one job as an HTTP worker with the example's client, prints it (a JSON line),
// waits for a line on stdin (the test makes the lease stale meanwhile), then completes it
// and prints what the API said: {"refused": true, "detail": …} for a 409.
import { createInterface } from "node:readline";
import { JobtierClient, LeaseLost } from "../../examples/node-worker/jobtier-worker.mjs";

const [url, key, type] = process.argv.slice(2);
const client = new JobtierClient({ url, key, worker: "node-stale" });
const { jobs } = await client.claim({ types: [type], queues: ["default"], count: 1, wait: 10 });
console.log(JSON.stringify(jobs[0] ?? null));
const lines = createInterface({ input: process.stdin });
for await (const _ of lines) break;
try {
  const answer = await client.complete(jobs[0], { late: true });
  console.log(JSON.stringify({ refused: false, answer }));
} catch (err) {
  if (!(err instanceof LeaseLost)) throw err;
  console.log(JSON.stringify({ refused: true, job_id: err.jobId, detail: err.message }));
}
lines.close();
