// Starts a grpc-js server for protobuf-es services, with standard health checking
// (grpc.health.v1) and server reflection, so grpcurl / buf curl / grpc_health_probe work.
import { Server, ServerCredentials } from '@grpc/grpc-js';
import type { ChannelOptions } from '@grpc/grpc-js';
import { HealthImplementation } from 'grpc-health-check';
import type { ServingStatus } from 'grpc-health-check';
import { ReflectionService } from '@grpc/reflection';
import { toBinary } from '@bufbuild/protobuf';
import type { DescFile } from '@bufbuild/protobuf';
import { FileDescriptorProtoSchema } from '@bufbuild/protobuf/wkt';
import { grpcHandlers } from './rpc.ts';
import type { CallGuard, ErrorHook, ServiceRegistration } from './rpc.ts';

export interface GrpcServerOptions {
  /** host:port; port 0 picks a free one. */
  address: string;
  services: readonly ServiceRegistration[];
  /** Insecure when omitted (peer transfer, in-process tests); the Fleet API always passes TLS. */
  credentials?: ServerCredentials;
  /** Admits every call of `services` (not health or reflection, which stay open). */
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
  setServing(status: ServingStatus): void;
  /** Graceful shutdown, forced after `graceMs`. */
  close(graceMs?: number): Promise<void>;
}

function collectFiles(file: DescFile, into: Map<string, DescFile>): void {
  if (into.has(file.name)) return;
  for (const dep of file.dependencies) collectFiles(dep, into);
  into.set(file.name, file);
}

/** A proto-loader-shaped package definition, which is what @grpc/reflection reads. */
function reflectionPackage(services: readonly ServiceRegistration[]): ConstructorParameters<typeof ReflectionService>[0] {
  const files = new Map<string, DescFile>();
  for (const s of services) collectFiles(s.service.file, files);
  const fileDescriptorProtos = [...files.values()].map((f) => Buffer.from(toBinary(FileDescriptorProtoSchema, f.proto)));
  const pkg: Record<string, { format: string; type: object; fileDescriptorProtos: Buffer[] }> = {};
  for (const s of services) pkg[s.service.typeName] = { format: 'Protocol Buffer 3 DescriptorProto', type: {}, fileDescriptorProtos };
  return pkg as unknown as ConstructorParameters<typeof ReflectionService>[0];
}

export async function startGrpcServer(opts: GrpcServerOptions): Promise<RunningGrpcServer> {
  const server = new Server({
    'grpc.max_receive_message_length': 16 * 1024 * 1024,
    // A client that vanished without closing its connection (powered off, a NAT mapping gone)
    // sends no cancel: without pings its streams (a WatchEvents' etcd watch, a slot of its
    // credential's stream limit) stay until TCP gives up, ~15 min, or never on a quiet link.
    'grpc.keepalive_time_ms': 30_000,
    'grpc.keepalive_timeout_ms': 10_000,
    ...opts.channelOptions,
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
  return {
    server,
    port,
    address: `${host}:${port}`,
    health,
    setServing(status) {
      for (const name of Object.keys(statusMap)) health.setStatus(name, status);
    },
    close(graceMs = 2000) {
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
