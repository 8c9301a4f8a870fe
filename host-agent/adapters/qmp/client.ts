// Async QMP client over a unix socket: commands with ids and timeouts, events to listeners,
// and a close signal (QEMU exited). One instance per QEMU process.
import { EventEmitter } from 'node:events';
import net from 'node:net';
import { ChannelClosedError, QmpCommandError, QmpTimeoutError } from '../../errors.ts';

export interface QmpEvent {
  event: string;
  data: Record<string, unknown>;
  /** Host wall-clock time QEMU stamped on the event, in ms. */
  timestampMs: number;
}

interface Pending {
  command: string;
  resolve: (v: unknown) => void;
  reject: (e: Error) => void;
  timer: NodeJS.Timeout;
}

export class QmpClient {
  private readonly sock: net.Socket;
  private readonly pending = new Map<number, Pending>();
  private readonly emitter = new EventEmitter();
  private nextId = 1;
  private buf = '';
  private closedError: Error | undefined;
  /** Events seen so far, kept so a waiter can ask for an event that already arrived. */
  readonly history: QmpEvent[] = [];

  private constructor(sock: net.Socket) {
    this.sock = sock;
    this.emitter.setMaxListeners(0);
    sock.setEncoding('utf8');
    sock.on('data', (chunk: string) => this.onData(chunk));
    sock.on('error', () => undefined);
    sock.on('close', () => this.handleClose());
  }

  /** Connect, read the greeting and negotiate capabilities. */
  static async connect(path: string, timeoutMs = 5000): Promise<QmpClient> {
    const sock = await new Promise<net.Socket>((resolve, reject) => {
      const s = net.createConnection(path);
      const t = setTimeout(() => {
        s.destroy();
        reject(new QmpTimeoutError(`connect ${path}`, timeoutMs));
      }, timeoutMs);
      s.once('connect', () => {
        clearTimeout(t);
        resolve(s);
      });
      s.once('error', (e) => {
        clearTimeout(t);
        reject(e);
      });
    });
    const c = new QmpClient(sock);
    await c.greeting(timeoutMs);
    await c.execute('qmp_capabilities', {}, timeoutMs);
    return c;
  }

  /** Retry connect until the socket exists and QEMU answers, or the deadline passes. */
  static async connectWithRetry(path: string, deadlineMs: number, isAlive: () => boolean): Promise<QmpClient> {
    const end = Date.now() + deadlineMs;
    let last: unknown;
    while (Date.now() < end) {
      if (!isAlive()) throw new ChannelClosedError(`QMP ${path} (QEMU exited before it listened)`, { cause: last });
      try {
        return await QmpClient.connect(path, Math.max(100, end - Date.now()));
      } catch (e) {
        last = e;
        await new Promise((r) => setTimeout(r, 5));
      }
    }
    throw new QmpTimeoutError(`connect ${path}`, deadlineMs);
  }

  private greetingWaiter: ((v: unknown) => void) | undefined;
  private greeting(timeoutMs: number): Promise<void> {
    return new Promise((resolve, reject) => {
      const t = setTimeout(() => reject(new QmpTimeoutError('greeting', timeoutMs)), timeoutMs);
      this.greetingWaiter = () => {
        clearTimeout(t);
        resolve();
      };
    });
  }

  get closed(): boolean {
    return this.closedError !== undefined;
  }

  execute<T = unknown>(command: string, args: Record<string, unknown> = {}, timeoutMs = 10_000): Promise<T> {
    if (this.closedError) return Promise.reject(this.closedError);
    const id = this.nextId++;
    return new Promise<T>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.pending.delete(id);
        reject(new QmpTimeoutError(command, timeoutMs));
      }, timeoutMs);
      this.pending.set(id, { command, resolve: resolve as (v: unknown) => void, reject, timer });
      const msg: Record<string, unknown> = { execute: command, id };
      if (Object.keys(args).length > 0) msg.arguments = args;
      this.sock.write(JSON.stringify(msg) + '\n');
    });
  }

  onEvent(listener: (e: QmpEvent) => void): () => void {
    this.emitter.on('event', listener);
    return () => this.emitter.off('event', listener);
  }

  /** Resolve with the first event (including ones already seen after `sinceIndex`) matching. */
  waitEvent(name: string, timeoutMs: number, match: (e: QmpEvent) => boolean = () => true, sinceIndex = 0): Promise<QmpEvent> {
    const seen = this.history.slice(sinceIndex).find((e) => e.event === name && match(e));
    if (seen) return Promise.resolve(seen);
    if (this.closedError) return Promise.reject(this.closedError);
    return new Promise((resolve, reject) => {
      const off = (): void => {
        clearTimeout(t);
        this.emitter.off('event', onEv);
        this.emitter.off('closed', onClosed);
      };
      const onEv = (e: QmpEvent): void => {
        if (e.event === name && match(e)) {
          off();
          resolve(e);
        }
      };
      const onClosed = (err: Error): void => {
        off();
        reject(err);
      };
      const t = setTimeout(() => {
        off();
        reject(new QmpTimeoutError(`event ${name}`, timeoutMs));
      }, timeoutMs);
      this.emitter.on('event', onEv);
      this.emitter.on('closed', onClosed);
    });
  }

  /** Calls listener once when the connection closes (QEMU exited or quit). */
  onClosed(listener: (e: Error) => void): void {
    if (this.closedError) listener(this.closedError);
    else this.emitter.once('closed', listener);
  }

  private handleClose(): void {
    if (this.closedError) return;
    this.closedError = new ChannelClosedError('QMP');
    for (const [, p] of this.pending) {
      clearTimeout(p.timer);
      p.reject(this.closedError);
    }
    this.pending.clear();
    this.emitter.emit('closed', this.closedError);
  }

  close(): void {
    this.sock.destroy();
  }

  private onData(chunk: string): void {
    this.buf += chunk;
    let nl: number;
    while ((nl = this.buf.indexOf('\n')) >= 0) {
      const line = this.buf.slice(0, nl).trim();
      this.buf = this.buf.slice(nl + 1);
      if (line) this.onMessage(JSON.parse(line) as Record<string, unknown>);
    }
  }

  private onMessage(msg: Record<string, unknown>): void {
    if ('QMP' in msg) {
      this.greetingWaiter?.(msg);
      return;
    }
    if (typeof msg.event === 'string') {
      const ts = msg.timestamp as { seconds: number; microseconds: number } | undefined;
      const ev: QmpEvent = {
        event: msg.event,
        data: (msg.data as Record<string, unknown>) ?? {},
        timestampMs: ts ? ts.seconds * 1000 + ts.microseconds / 1000 : Date.now(),
      };
      this.history.push(ev);
      if (this.history.length > 256) this.history.shift();
      this.emitter.emit('event', ev);
      return;
    }
    const id = msg.id as number | undefined;
    if (id === undefined) return;
    const p = this.pending.get(id);
    if (!p) return;
    this.pending.delete(id);
    clearTimeout(p.timer);
    if ('error' in msg) {
      const err = msg.error as { class: string; desc: string };
      p.reject(new QmpCommandError(p.command, err.class, err.desc));
    } else {
      p.resolve(msg.return);
    }
  }
}
