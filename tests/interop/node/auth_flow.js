// Auth probes run by the official Node.js client (npm rocketmq-client-nodejs), in its own process.
//
// Usage: node auth_flow.js ENDPOINT ACCESS_KEY SECRET_KEY TOPIC GROUP
// With the given credentials (an empty access key: no sessionCredentials, so no authorization
// header), a Producer starts, sends a normal message and a timer message and recalls the timer;
// a SimpleConsumer in GROUP starts and receives from TOPIC. Each step is recorded as {ok: true} or
// {ok: false, error: "..."} (the client's error carries the server's code); every step has a
// time limit, since the client waits without one for a Telemetry settings reply. Prints one JSON
// object; the pytest side asserts.
'use strict';

const { Producer, SimpleConsumer } = require('rocketmq-client-nodejs');

const STEP_LIMIT_MS = 8000;
const logged = [];  // the client's own error lines: they carry the code of a refused route query
const record = (...args) => { logged.push(args.map(a => (typeof a === 'string' ? a : JSON.stringify(a))).join(' ')); };
const quietLogger = { info() {}, warn: record, debug() {}, error: record, trace() {}, log() {}, fatal: record };

function limited(promise) {
  let timer;
  const limit = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`no answer within ${STEP_LIMIT_MS} ms`)), STEP_LIMIT_MS);
  });
  return Promise.race([promise, limit]).finally(() => clearTimeout(timer));
}

async function step(report, name, body) {
  try {
    const value = await limited(body());
    report[name] = { ok: true };
    return value;
  } catch (err) {
    report[name] = { ok: false, error: String(err && (err.message || err)) };
    return undefined;
  }
}

async function main(endpoint, ak, sk, topic, group) {
  const report = {};
  const sessionCredentials = ak ? { accessKey: ak, accessSecret: sk } : undefined;
  const producer = new Producer({ endpoints: endpoint, namespace: '', topics: [topic], logger: quietLogger,
    sessionCredentials });
  if (await step(report, 'producer_startup', () => producer.startup().then(() => true))) {
    await step(report, 'send', () => producer.send({ topic, body: Buffer.from('auth-normal') }));
    const receipt = await step(report, 'send_timer', () => producer.send({
      topic, body: Buffer.from('auth-timer'), deliveryTimestamp: new Date(Date.now() + 60000) }));
    if (receipt) await step(report, 'recall', () => producer.recallMessage(topic, receipt.recallHandle));
  }
  await producer.shutdown().catch(() => {});
  const consumer = new SimpleConsumer({
    endpoints: endpoint, namespace: '', consumerGroup: group, subscriptions: new Map().set(topic, '*'),
    awaitDuration: 2000, logger: quietLogger, sessionCredentials,
  });
  if (await step(report, 'consumer_startup', () => consumer.startup().then(() => true))) {
    report.received = await step(report, 'receive', async () => {
      const giveUp = Date.now() + 6000;
      let got = 0;
      while (Date.now() < giveUp && !got) {
        for (const m of await consumer.receive(16, 15000)) { await consumer.ack(m); got += 1; }
      }
      return got;
    });
  }
  await consumer.shutdown().catch(() => {});
  report.log = logged.filter(line => /\b40[0-9]{3}\b/.test(line)).slice(0, 20);
  return report;
}

main(...process.argv.slice(2, 7)).then(
  report => { process.stdout.write(JSON.stringify(report) + '\n'); process.exit(0); },
  err => { process.stdout.write(JSON.stringify({ fatal: String(err && err.stack || err) }) + '\n'); process.exit(1); },
);
