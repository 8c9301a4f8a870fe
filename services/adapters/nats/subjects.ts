// NATS subjects and JetStream streams shared by the scheduler and host agents.
// Control traffic only: commands, results, events, heartbeats. Bulk bytes go peer to peer.
import type { JetStreamManager } from 'nats';
import { AckPolicy, DeliverPolicy, RetentionPolicy } from 'nats';

export const subjects = {
  work: (hostId: string) => `ff.work.${hostId}`,
  result: (hostId: string) => `ff.result.${hostId}`,
  heartbeat: (hostId: string) => `ff.heartbeat.${hostId}`,
  event: (hostId: string) => `ff.event.${hostId}`,
  exec: (hostId: string) => `ff.exec.${hostId}`,
  file: (hostId: string) => `ff.file.${hostId}`,
  /** Exec output from a host streams to `<this>.<unique id>` (the scheduler's per-call reply subject). */
  execOut: (hostId: string) => `ff.execout.${hostId}`,
  /** HostExecCancel: the caller of an exec on this host is gone; the host kills the command. */
  execCancel: (hostId: string) => `ff.execcancel.${hostId}`,
  /** HostExecAlive: the execs on this host whose caller still waits (HostExecRequest.keepalive). */
  execAlive: (hostId: string) => `ff.execalive.${hostId}`,
  allHeartbeats: 'ff.heartbeat.*',
  allEvents: 'ff.event.*',
  allResults: 'ff.result.*',
};

export const STREAM_WORK = 'FF_WORK';
export const STREAM_RESULTS = 'FF_RESULTS';
export const STREAM_EVENTS = 'FF_EVENTS';
/** Durable consumer of results; shared by scheduler replicas, used by the leader. */
export const RESULTS_CONSUMER = 'scheduler-results';
export const workConsumer = (hostId: string) => `agent-${hostId.replace(/[^A-Za-z0-9_-]/g, '_')}`;
/** A host agent's inbox prefix: its NATS permissions let it subscribe only under this. */
export const agentInboxPrefix = (hostId: string) => `_INBOX_${hostId.replace(/[^A-Za-z0-9_-]/g, '_')}`;

/** Host ids appear in subjects: keep them to a safe alphabet. */
export const HOST_ID_RE = /^[a-z0-9][a-z0-9-]{0,62}$/;

/** How long a host may hold a work message before it is redelivered (it sends in-progress acks). */
export const WORK_ACK_WAIT_MS = 30_000;

async function ensureStream(jsm: JetStreamManager, name: string, subjectsList: string[], retention: RetentionPolicy, replicas: number): Promise<void> {
  const info = await jsm.streams.info(name).catch(() => undefined);
  if (info) {
    // A stream made with fewer replicas (an earlier config, or an agent of an open server) grows.
    if (info.config.num_replicas < replicas) await jsm.streams.update(name, { ...info.config, num_replicas: replicas });
    return;
  }
  try {
    await jsm.streams.add({ name, subjects: subjectsList, retention, max_age: 24 * 3600 * 1e9, num_replicas: replicas });
  } catch (e) {
    // Another replica created it concurrently.
    await jsm.streams.info(name).catch(() => {
      throw e;
    });
  }
}

/**
 * Creates the streams if missing, with `replicas` copies each (a NATS cluster of 3 or more
 * servers: 3, so a server's loss loses no work; one server: 1), and grows an existing
 * stream's replicas to that. Idempotent; every replica and agent may call it.
 */
export async function ensureStreams(jsm: JetStreamManager, replicas = 1): Promise<void> {
  // Work last: once it can be taken, its results and events have somewhere to go. Made the
  // other way round (streams lost under a running fleet and made again), a step taken in the
  // moment between got a "no stream" for its result.
  await ensureStream(jsm, STREAM_RESULTS, [subjects.allResults], RetentionPolicy.Workqueue, replicas);
  await ensureStream(jsm, STREAM_EVENTS, [subjects.allEvents], RetentionPolicy.Limits, replicas);
  await ensureStream(jsm, STREAM_WORK, ['ff.work.*'], RetentionPolicy.Workqueue, replicas);
}

/**
 * Runs a consumer call again (up to 5 times, 100 ms x attempt apart, `between` before each
 * retry) while nats-server answers with a race in its consumer store. A server without its
 * PR 7886 (the Debian 12 one) does not retry removing a consumer's directory when a last
 * state write lands in it ("directory not empty"; the consumer is out of the stream by then:
 * asked again, "not found"), and a consumer made again while its deletion still removes the
 * directory (RemoveHost under a running agent, which makes its queue at once) lives on with
 * no directory: every later add answers "open .../meta.inf: no such file or directory".
 */
export async function retryOnConsumerStoreRace<T>(call: () => Promise<T>, between: () => Promise<unknown> = async () => undefined): Promise<T> {
  for (let attempt = 1; ; attempt++) {
    try {
      return await call();
    } catch (e) {
      if (attempt >= 5 || !/no such file or directory|directory not empty/i.test((e as Error).message)) throw e;
      await new Promise((r) => setTimeout(r, 100 * attempt));
      await between();
    }
  }
}

/**
 * Creates (or finds) `hostId`'s durable work consumer. One the server lost the store of
 * (retryOnConsumerStoreRace) is deleted and made again; work in the stream is not lost with it
 * (a work-queue stream keeps a message until it is acked, and a new consumer delivers them
 * all; the agent dedups by op and step).
 */
export async function ensureWorkConsumer(jsm: JetStreamManager, hostId: string): Promise<string> {
  const name = workConsumer(hostId);
  await ensureDurable(jsm, STREAM_WORK, { durable_name: name, filter_subject: subjects.work(hostId), ack_wait: WORK_ACK_WAIT_MS * 1e6, max_deliver: 20 });
  return name;
}

/**
 * Adds (or finds) a durable consumer of `stream` with explicit acks that delivers everything
 * kept; one the server lost the store of is deleted and made again (retryOnConsumerStoreRace).
 */
async function ensureDurable(jsm: JetStreamManager, stream: string, config: { durable_name: string; ack_wait: number; filter_subject?: string; max_deliver?: number }): Promise<void> {
  await retryOnConsumerStoreRace(
    () => jsm.consumers.add(stream, { ack_policy: AckPolicy.Explicit, deliver_policy: DeliverPolicy.All, ...config }),
    () => jsm.consumers.delete(stream, config.durable_name).catch(() => undefined),
  );
}

/**
 * Creates (or finds) the schedulers' durable results consumer. As for a work consumer
 * (ensureWorkConsumer): one the server lost the store of is deleted and made again. Left so,
 * every add answered "no such file or directory" and no result reached any scheduler again:
 * every step waited out its timeout.
 */
export async function ensureResultsConsumer(jsm: JetStreamManager): Promise<void> {
  await ensureDurable(jsm, STREAM_RESULTS, { durable_name: RESULTS_CONSUMER, ack_wait: 30_000 * 1e6 });
}
