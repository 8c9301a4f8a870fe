// Async QMP client over a unix socket: commands with ids and timeouts, events to listeners,
// and a close signal (QEMU exited). One instance per QEMU process.
import { EventEmitter, once } from 'node:events';
import net from 'node:net';
import { ChannelClosedError, QmpCommandError, QmpTimeoutError } from '../../errors.ts';
import { connectUnix } from '../unix-connect.ts';

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

/**
 * Events a client remembers. A long-lived VM sees thousands (every pause, resume and
 * migration pass); marks are absolute, so dropping old ones never hides a new one.
 */
const HISTORY_MAX = 256;

export class QmpClient {
  private readonly sock: net.Socket;
  private readonly pending = new Map<number, Pending>();
  private readonly emitter = new EventEmitter();
  private nextId = 1;
  private buf = '';
  private closedError: Error | undefined;
  /** The last HISTORY_MAX events, kept so a waiter can ask for an event that already arrived. */
  private readonly history: QmpEvent[] = [];
  /** Events dropped from the front of `history`: marks count every event, dropped or not. */
  private dropped = 0;

  private readonly fdPassing: boolean;

  private constructor(sock: net.Socket) {
    this.sock = sock;
    this.fdPassing = ipcSockets.has(sock);
    this.emitter.setMaxListeners(0);
    sock.setEncoding('utf8');
    sock.on('data', (chunk: string) => this.onData(chunk));
    sock.on('error', () => undefined);
    sock.on('close', () => this.handleClose());
  }

  /**
   * Connect, read the greeting and negotiate capabilities. `fdPassing`: the connection can
   * also carry file descriptors to QEMU (executeWithFd).
   */
  static async connect(path: string, timeoutMs = 5000, o: { fdPassing?: boolean } = {}): Promise<QmpClient> {
    const sock = o.fdPassing ? await connectFdPassing(path, timeoutMs) : await connectUnix(path, timeoutMs, () => new QmpTimeoutError(`connect ${path}`, timeoutMs));
    const c = new QmpClient(sock);
    try {
      await c.greeting(timeoutMs);
      await c.execute('qmp_capabilities', {}, timeoutMs);
    } catch (e) {
      // QEMU serves one client per monitor socket: a connection given up on but left open
      // would be the one it serves next, and every later connect would wait behind it.
      c.close();
      throw e;
    }
    return c;
  }

  /** Retry connect until the socket exists and QEMU answers, or the deadline passes. */
  static async connectWithRetry(path: string, deadlineMs: number, isAlive: () => boolean, o: { fdPassing?: boolean } = {}): Promise<QmpClient> {
    const end = Date.now() + deadlineMs;
    let last: unknown;
    while (Date.now() < end) {
      // A connection closed before the greeting (QEMU failed to start and is exiting) is tried
      // again until the process is seen gone: the caller then reports QEMU's own error (its log).
      if (!isAlive()) throw new ChannelClosedError(`QMP ${path} (QEMU exited before it answered)`, { cause: last });
      try {
        return await QmpClient.connect(path, Math.max(100, end - Date.now()), o);
      } catch (e) {
        last = e;
        await new Promise((r) => setTimeout(r, 5));
      }
    }
    throw new QmpTimeoutError(`connect ${path}`, deadlineMs);
  }

  private greetingWaiter: { resolve: () => void; reject: (e: Error) => void } | undefined;
  /**
   * Settles on the greeting, the timeout, or the connection closing (handleClose): QEMU makes
   * its QMP socket before it opens drives, memory backends and the kernel, and one that fails
   * at those exits. Waiting out the timeout then (10 s and more per GiB for a receiver) would
   * only delay the error.
   */
  private greeting(timeoutMs: number): Promise<void> {
    return new Promise((resolve, reject) => {
      const t = setTimeout(() => reject(new QmpTimeoutError('greeting', timeoutMs)), timeoutMs);
      this.greetingWaiter = {
        resolve: () => {
          clearTimeout(t);
          resolve();
        },
        reject: (e) => {
          clearTimeout(t);
          reject(e);
        },
      };
    });
  }

  get closed(): boolean {
    return this.closedError !== undefined;
  }

  execute<T = unknown>(command: string, args: Record<string, unknown> = {}, timeoutMs = 10_000): Promise<T> {
    return this.send<T>(command, args, timeoutMs, (line) => this.sock.write(line));
  }

  /**
   * `command` (getfd, add-fd) with the file descriptor of `fd` attached (SCM_RIGHTS), so QEMU
   * holds its own copy once this resolves. Only on a client connected with `fdPassing`.
   */
  async executeWithFd<T = unknown>(command: string, args: Record<string, unknown>, fd: net.Socket, timeoutMs = 10_000): Promise<T> {
    const handle = (this.sock as unknown as { _handle?: IpcPipe })._handle;
    const target = (fd as unknown as { _handle?: unknown })._handle;
    if (!this.fdPassing || !handle) throw new Error('QMP: this connection cannot pass file descriptors');
    if (!target) throw new Error(`QMP ${command}: the socket to pass has no handle (closed?)`);
    // The handle-passing write bypasses the socket's queue: let queued commands go first.
    if (this.sock.writableLength > 0) await once(this.sock, 'drain');
    return this.send<T>(command, args, timeoutMs, (line) => writeWithHandle(handle, line, target));
  }

  private send<T>(command: string, args: Record<string, unknown>, timeoutMs: number, write: (line: string) => void): Promise<T> {
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
      try {
        write(JSON.stringify(msg) + '\n');
      } catch (e) {
        this.pending.delete(id);
        clearTimeout(timer);
        reject(e as Error);
      }
    });
  }

  onEvent(listener: (e: QmpEvent) => void): () => void {
    this.emitter.on('event', listener);
    return () => this.emitter.off('event', listener);
  }

  /**
   * A position in this connection's event stream (the number of events seen so far): what
   * arrives after it is `eventsSince(mark)`. It stays valid however many events come later.
   */
  get mark(): number {
    return this.dropped + this.history.length;
  }

  /** The events after `mark` (taken with `mark`); those older than the last HISTORY_MAX are gone. */
  eventsSince(mark: number): QmpEvent[] {
    return this.history.slice(Math.max(0, mark - this.dropped));
  }

  /** Resolve with the first event matching, including one already seen after `sinceMark` (a `mark`). */
  waitEvent(name: string, timeoutMs: number, match: (e: QmpEvent) => boolean = () => true, sinceMark = 0): Promise<QmpEvent> {
    const seen = this.eventsSince(sinceMark).find((e) => e.event === name && match(e));
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
    this.greetingWaiter?.reject(this.closedError);
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
      this.greetingWaiter?.resolve();
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
      if (this.history.length > HISTORY_MAX) {
        this.history.shift();
        this.dropped++;
      }
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

// ---------------------------------------------------------------- passing file descriptors
// QEMU takes file descriptors (getfd) only as SCM_RIGHTS ancillary data on its monitor socket,
// and Node has no public API for that: child_process uses it, through an IPC-mode libuv pipe,
// for its own messages only. So a connection that must pass one is made on such a pipe (the
// `pipe_wrap` binding, the one internal API this file relies on), and the command carrying the
// descriptor is written with the binding's handle-passing write. Everything else on the
// connection is a plain net.Socket. The rest of the driver never needs this; only a QEMU that
// was started before its migration stream arrived does (ADR 0015, incoming standbys).

interface IpcPipe {
  writeUtf8String(req: unknown, data: string, sendHandle: unknown): number;
}

interface PipeWrapBinding {
  Pipe: new (type: number) => IpcPipe & { connect(req: unknown, path: string): number; close(): void };
  PipeConnectWrap: new () => { oncomplete: (status: number) => void };
  constants: { IPC: number };
}

interface StreamWrapBinding {
  WriteWrap: new () => { handle: unknown; oncomplete: (status: number) => void; async: boolean };
}

const ipcSockets = new WeakSet<net.Socket>();

function binding<T>(name: string): T {
  return (process as unknown as { binding(n: string): T }).binding(name);
}

/** A net.Socket connected to the unix socket `path` on an IPC-mode pipe handle. */
function connectFdPassing(path: string, timeoutMs: number): Promise<net.Socket> {
  const { Pipe, PipeConnectWrap, constants } = binding<PipeWrapBinding>('pipe_wrap');
  const pipe = new Pipe(constants.IPC);
  return new Promise<net.Socket>((resolve, reject) => {
    const fail = (e: Error): void => {
      clearTimeout(t);
      pipe.close();
      reject(e);
    };
    const t = setTimeout(() => fail(new QmpTimeoutError(`connect ${path}`, timeoutMs)), timeoutMs);
    const req = new PipeConnectWrap();
    req.oncomplete = (status) => {
      if (status !== 0) return fail(new ChannelClosedError(`QMP ${path} (connect: uv error ${status})`));
      clearTimeout(t);
      // Connected first, then wrapped: a socket made on a handle starts reading at once.
      const s = new net.Socket({ handle: pipe, readable: true, writable: true } as net.SocketConstructorOpts);
      ipcSockets.add(s);
      resolve(s);
    };
    const err = pipe.connect(req, path);
    if (err !== 0) fail(new ChannelClosedError(`QMP ${path} (connect: uv error ${err})`));
  });
}

/** Writes `data` with `sendHandle`'s descriptor attached; throws when the write is refused. */
function writeWithHandle(pipe: IpcPipe, data: string, sendHandle: unknown): void {
  const { WriteWrap } = binding<StreamWrapBinding>('stream_wrap');
  const req = new WriteWrap();
  req.handle = pipe;
  req.async = false;
  // Errors after dispatch surface as the connection closing, which fails the pending command.
  req.oncomplete = () => undefined;
  const err = pipe.writeUtf8String(req, data, sendHandle);
  if (err !== 0) throw new Error(`QMP: passing a file descriptor failed (uv error ${err})`);
}
