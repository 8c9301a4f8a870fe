// Starts a grpc-js server for protobuf-es services, with standard health checking
// (grpc.health.v1) and server reflection, so grpcurl / buf curl / grpc_health_probe work.
import { Server, ServerCredentials } from '@grpc/grpc-js';
import type { ChannelOptions } from '@grpc/grpc-js';
import { HealthImplementation, service as healthService } from 'grpc-health-check';
import type { ServingStatus } from 'grpc-health-check';
import { ReflectionService } from '@grpc/reflection';
import { fromBinary, toBinary } from '@bufbuild/protobuf';
import type { DescFile } from '@bufbuild/protobuf';
import { FileDescriptorProtoSchema } from '@bufbuild/protobuf/wkt';
import type { DescriptorProto, FileDescriptorProto } from '@bufbuild/protobuf/wkt';
import { grpcHandlers, guardInterceptor, methodPath } from './rpc.ts';
import type { CallGuard, ErrorHook, ServiceRegistration } from './rpc.ts';

export interface GrpcServerOptions {
  /** host:port; port 0 picks a free one. */
  address: string;
  services: readonly ServiceRegistration[];
  /** Insecure when omitted (peer transfer, in-process tests); the Fleet API always passes TLS. */
  credentials?: ServerCredentials;
  /** Admits every call of `services` from its headers, before its messages are read (guardInterceptor); not health or reflection, which stay open. */
  guard?: CallGuard;
  /** Called with every error a handler threw, before it is mapped to a status. */
  onError?: ErrorHook;
  channelOptions?: ChannelOptions;
}

export interface RunningGrpcServer {
  readonly server: Server;
  readonly port: number;
  /** host:port clients dial. */
  readonly address: string;
  readonly health: HealthImplementation;
  /** Every service's health status (and the server's, ''); ignored once close() began. */
  setServing(status: ServingStatus): void;
  /** NOT_SERVING at once (health watchers and probes hear it first), then a graceful shutdown, forced after `graceMs`. */
  close(graceMs?: number): Promise<void>;
}

/** A condition a replica needs to answer calls: etcd reachable, NATS connected. */
export interface ReadinessCheck {
  readonly name: string;
  /** Whether it holds now; a rejection, or no answer within the timeout, counts as no. */
  ready(): boolean | Promise<boolean>;
}

export interface ReadinessOptions {
  /** Pause between two rounds of checks. */
  readonly everyMs: number;
  /** How long a check may take to answer before it counts as failed. */
  readonly timeoutMs: number;
  /** Told each time the status changes (from SERVING, the server's status at its start): `failing` names the checks that failed. */
  readonly onChange?: (serving: boolean, failing: readonly string[]) => void;
}

export interface Readiness {
  /** One round now (rounds never overlap: this one waits for a running round, then runs); resolves with whether all checks passed. */
  check(): Promise<boolean>;
  stop(): void;
}

async function passes(c: ReadinessCheck, timeoutMs: number): Promise<boolean> {
  let t: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([
      Promise.resolve().then(() => c.ready()),
      new Promise<boolean>((resolve) => {
        t = setTimeout(() => resolve(false), timeoutMs);
      }),
    ]);
  } catch {
    return false;
  } finally {
    clearTimeout(t);
  }
}

/**
 * Keeps a server's health status in step with `checks`, all asked every `everyMs` (the
 * first round at once): NOT_SERVING while any fails, so probes and load balancers
 * (grpc_health_probe, Envoy's and grpc-js's health checking) send calls to replicas that can
 * answer them; SERVING again once all pass. A replica cut off from etcd would answer every
 * call UNAVAILABLE while it reported SERVING.
 */
export function followReadiness(server: Pick<RunningGrpcServer, 'setServing'>, checks: readonly ReadinessCheck[], opts: ReadinessOptions): Readiness {
  let stopped = false;
  let serving = true; // as startGrpcServer starts it
  let timer: NodeJS.Timeout | undefined;
  let round: Promise<boolean> = Promise.resolve(true);
  const runRound = async (): Promise<boolean> => {
    const results = await Promise.all(checks.map((c) => passes(c, opts.timeoutMs)));
    const failing = checks.filter((_, i) => !results[i]).map((c) => c.name);
    const now = failing.length === 0;
    if (!stopped && now !== serving) {
      serving = now;
      server.setServing(now ? 'SERVING' : 'NOT_SERVING');
      opts.onChange?.(now, failing);
    }
    return now;
  };
  const check = (): Promise<boolean> => (round = round.then(runRound, runRound));
  const schedule = (): void => {
    if (stopped) return;
    timer = setTimeout(() => void check().finally(schedule), opts.everyMs);
    timer.unref();
  };
  void check().finally(schedule);
  return {
    check,
    stop() {
      stopped = true;
      clearTimeout(timer);
    },
  };
}

function collectFiles(file: DescFile, into: Map<string, DescFile>): void {
  if (into.has(file.name)) return;
  for (const dep of file.dependencies) collectFiles(dep, into);
  into.set(file.name, file);
}

/**
 * `file`, a descriptor protobufjs wrote (proto-loader's), as protoc would have written it, which
 * is what reflection clients read: protobufjs names a map field's entry type after the field
 * (`Statuses`, not `StatusesEntry`), which Go's descriptor checks refuse (buf curl and grpcurl:
 * "failed to find service named grpc.health.v1.Health in schema"); and it keeps a type name as
 * the .proto spelled it (`HealthCheckResponse`), which protobuf-es's registries refuse: here it
 * is qualified (`.grpc.health.v1.HealthCheckResponse`), looked up from the innermost scope
 * outwards, as protoc does, among the file's own types (health.proto imports none).
 */
export function asProtocWritesIt(file: FileDescriptorProto): FileDescriptorProto {
  const root = file.package ? `.${file.package}` : '';
  const defined = new Set<string>();
  const collect = (scope: string, messages: DescriptorProto[], enums: Array<{ name: string }>): void => {
    for (const e of enums) defined.add(`${scope}.${e.name}`);
    for (const m of messages) {
      defined.add(`${scope}.${m.name}`);
      collect(`${scope}.${m.name}`, m.nestedType, m.enumType);
    }
  };
  collect(root, file.messageType, file.enumType);
  const qualified = (name: string, scope: string): string => {
    for (let s = scope; ; s = s.slice(0, s.lastIndexOf('.'))) {
      if (defined.has(`${s}.${name}`)) return `${s}.${name}`;
      if (s === '') return name;
    }
  };
  // Assigned only when relative: descriptor.proto is proto2, where assigning '' to a scalar
  // field's unset type_name would set it.
  const relative = (name: string): boolean => name !== '' && !name.startsWith('.');
  const fix = (scope: string, messages: DescriptorProto[]): void => {
    for (const m of messages) {
      const name = `${scope}.${m.name}`;
      for (const f of m.field) {
        if (relative(f.typeName)) f.typeName = qualified(f.typeName, name);
        const entry = m.nestedType.find((n) => n.options?.mapEntry && f.typeName === `${name}.${n.name}`);
        if (entry) {
          entry.name = `${f.name.replace(/(?:^|_)(.)/g, (_, c: string) => c.toUpperCase())}Entry`;
          f.typeName = `${name}.${entry.name}`;
        }
      }
      fix(name, m.nestedType);
    }
  };
  fix(root, file.messageType);
  for (const s of file.service) {
    for (const m of s.method) {
      if (relative(m.inputType)) m.inputType = qualified(m.inputType, root);
      if (relative(m.outputType)) m.outputType = qualified(m.outputType, root);
    }
  }
  return file;
}

/**
 * A proto-loader-shaped package definition, which is what @grpc/reflection reads: the files of
 * `services` and of the health service (grpc.health.v1), so that tools that find a method by
 * reflection (buf curl, grpcurl) can call Health/Check too.
 */
function reflectionPackage(services: readonly ServiceRegistration[]): ConstructorParameters<typeof ReflectionService>[0] {
  const files = new Map<string, DescFile>();
  for (const s of services) collectFiles(s.service.file, files);
  const fileDescriptorProtos = [...files.values()].map((f) => Buffer.from(toBinary(FileDescriptorProtoSchema, f.proto)));
  const pkg: Record<string, { format: string; type: object; fileDescriptorProtos: Buffer[] }> = {};
  for (const s of services) pkg[s.service.typeName] = { format: 'Protocol Buffer 3 DescriptorProto', type: {}, fileDescriptorProtos };
  // grpc-health-check loads health.proto with proto-loader, not protobuf-es: its message types
  // carry the file's descriptor (the same one each; reflection keeps one per file name).
  const health = Object.values(healthService).flatMap((m) => m.requestType.fileDescriptorProtos);
  pkg['grpc.health.v1.Health'] = {
    format: 'Protocol Buffer 3 DescriptorProto',
    type: {},
    fileDescriptorProtos: health.map((b) => Buffer.from(toBinary(FileDescriptorProtoSchema, asProtocWritesIt(fromBinary(FileDescriptorProtoSchema, b))))),
  };
  return pkg as unknown as ConstructorParameters<typeof ReflectionService>[0];
}

/**
 * HTTP/2 streams (calls) open at once on one connection, at most (SETTINGS_MAX_CONCURRENT_STREAMS;
 * a client queues those past it). Without it a connection could open as many as it liked, each
 * holding a request of up to grpc.max_receive_message_length.
 */
export const MAX_CONCURRENT_STREAMS = 1000;

export async function startGrpcServer(opts: GrpcServerOptions): Promise<RunningGrpcServer> {
  // The guard admits the calls of `services` from their headers (guardInterceptor), before
  // their messages are read; health and reflection stay open.
  const guarded = new Set(opts.services.flatMap((reg) => reg.service.methods.map(methodPath)));
  const server = new Server({
    'grpc.max_receive_message_length': 16 * 1024 * 1024,
    'grpc.max_concurrent_streams': MAX_CONCURRENT_STREAMS,
    // A client that vanished without closing its connection (powered off, a NAT mapping gone)
    // sends no cancel: without pings its streams (a WatchEvents' etcd watch, a slot of its
    // credential's stream limit) stay until TCP gives up, ~15 min, or never on a quiet link.
    'grpc.keepalive_time_ms': 30_000,
    'grpc.keepalive_timeout_ms': 10_000,
    ...opts.channelOptions,
    ...(opts.guard ? { interceptors: [guardInterceptor(opts.guard, guarded, opts.onError)] } : {}),
  });
  for (const reg of opts.services) {
    server.addService(reg.definition, grpcHandlers(reg, opts.onError, opts.guard) as never);
  }
  const statusMap: Record<string, ServingStatus> = { '': 'SERVING' };
  for (const reg of opts.services) statusMap[reg.service.typeName] = 'SERVING';
  const health = new HealthImplementation(statusMap);
  health.addToServer(server);
  new ReflectionService(reflectionPackage(opts.services)).addToServer(server);

  const port = await new Promise<number>((resolve, reject) => {
    server.bindAsync(opts.address, opts.credentials ?? ServerCredentials.createInsecure(), (err, p) => (err ? reject(err) : resolve(p)));
  });
  const host = opts.address.slice(0, opts.address.lastIndexOf(':'));
  let closing = false;
  const setAll = (status: ServingStatus): void => {
    for (const name of Object.keys(statusMap)) health.setStatus(name, status);
  };
  return {
    server,
    port,
    address: `${host}:${port}`,
    health,
    setServing(status) {
      if (!closing) setAll(status);
    },
    close(graceMs = 2000) {
      // Health watchers (Watch streams) hear NOT_SERVING before the server's GOAWAY, and a
      // Check during the shutdown answers it, so no new calls are routed here.
      closing = true;
      setAll('NOT_SERVING');
      return new Promise<void>((resolve) => {
        const force = setTimeout(() => {
          server.forceShutdown();
          resolve();
        }, graceMs);
        server.tryShutdown(() => {
          clearTimeout(force);
          resolve();
        });
      });
    },
  };
}
