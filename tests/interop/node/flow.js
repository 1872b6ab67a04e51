// Interop flow for the official Node.js client (npm rocketmq-client-nodejs), run in its own process.
//
// Usage: node flow.js ENDPOINT TOPIC GROUP
// A Producer sends a normal message, a timer message (`delay`, 3 s), and a timer message
// (`deliveryTimestamp`, 4 s) that it recalls at once. A SimpleConsumer receives until both live
// messages arrived and the recalled one's time plus a margin has passed, changes the invisible
// duration of the first message it gets to 2 s (acking with the renewed handle), and acks everything.
// Prints one JSON object (times in ms since the epoch); the pytest side asserts.
'use strict';

const { Producer, SimpleConsumer } = require('rocketmq-client-nodejs');

const TIMER_DELAY_MS = 3000;
const RECALLED_DELAY_MS = 4000;
const RECALL_WATCH_MARGIN_MS = 1500;
const GIVE_UP_MS = 15000;

const quietLogger = { info() {}, warn() {}, debug() {}, error() {}, trace() {}, log() {}, fatal() {} };

async function receiveAll(consumer, report, watchUntilMs) {
  const received = [];
  let changed = false;
  const giveUpMs = Date.now() + GIVE_UP_MS;
  while (Date.now() < giveUpMs) {
    const ids = new Set(received.map(r => r.id));
    if (ids.has(report.normal_id) && ids.has(report.timer_id) && Date.now() >= watchUntilMs) break;
    const messages = await consumer.receive(16, 15000);
    for (const msg of messages) {
      const entry = {
        id: msg.messageId, body: msg.body.toString(), tag: msg.tag ?? null, arrived_ms: Date.now(),
        attempt: msg.deliveryAttempt ?? null, corrupted: msg.corrupted === true,
        properties: Object.fromEntries(msg.properties ?? new Map()), keys: [...(msg.keys ?? [])].sort(),
      };
      if (!changed) {
        const oldHandle = msg.receiptHandle;
        await consumer.changeInvisibleDuration(msg, 2000);
        entry.changed_invisible = msg.receiptHandle !== oldHandle;
        changed = true;
      }
      await consumer.ack(msg);
      entry.acked = true;
      received.push(entry);
    }
  }
  return received;
}

async function main(endpoint, topic, group) {
  const report = {};
  const producer = new Producer({ endpoints: endpoint, namespace: '', topics: [topic], logger: quietLogger });
  await producer.startup();
  const consumer = new SimpleConsumer({
    endpoints: endpoint, namespace: '', consumerGroup: group, subscriptions: new Map().set(topic, '*'),
    awaitDuration: 2000, logger: quietLogger,
  });
  await consumer.startup();
  try {
    let receipt = await producer.send({
      topic, tag: 'TagN', keys: ['key-normal'], body: Buffer.from('normal-body'),
      properties: new Map().set('color', 'red'),
    });
    report.normal_id = receipt.messageId;
    report.normal_sent_ms = Date.now();

    const before = Date.now();
    receipt = await producer.send({ topic, tag: 'TagT', body: Buffer.from('timer-body'), delay: TIMER_DELAY_MS });
    report.timer_id = receipt.messageId;
    report.timer_sent_before_ms = before;  // the client computes its deadline from `delay` in between
    report.timer_sent_after_ms = Date.now();
    report.timer_recall_handle_present = Boolean(receipt.recallHandle);

    const recalledAtMs = Date.now() + RECALLED_DELAY_MS;
    receipt = await producer.send({ topic, body: Buffer.from('recalled-body'), deliveryTimestamp: new Date(recalledAtMs) });
    report.recalled_id = receipt.messageId;
    report.recalled_deliver_at_ms = recalledAtMs;
    const recall = await producer.recallMessage(topic, receipt.recallHandle);
    report.recall_returned_id = recall.messageId;

    report.received = await receiveAll(consumer, report, recalledAtMs + RECALL_WATCH_MARGIN_MS);
  } finally {
    await consumer.shutdown().catch(() => {});
    await producer.shutdown().catch(() => {});
  }
  return report;
}

main(...process.argv.slice(2, 5)).then(
  report => { process.stdout.write(JSON.stringify(report) + '\n'); process.exit(0); },
  err => { process.stdout.write(JSON.stringify({ fatal: String(err && err.stack || err) }) + '\n'); process.exit(1); },
);
