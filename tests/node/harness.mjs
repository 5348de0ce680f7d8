// The tests' Node scripts' common run: register the worker's tasks, print "ready", run it,
// hand each line of stdin to `onLine` until "stop", then stop the worker and print its counts
// as JSON once its running jobs have ended.
import { createInterface } from "node:readline";

export async function runUntilStopped(worker, onLine) {
  await worker.register();
  console.log("ready");
  const running = worker.run();
  for await (const line of createInterface({ input: process.stdin })) {
    if (line === "stop") break;
    onLine(line);
  }
  worker.stop();
  await running;
  console.log(JSON.stringify(worker.stats));
}
