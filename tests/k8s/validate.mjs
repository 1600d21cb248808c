// Validates rendered Kubernetes manifests strictly, two independent ways, and checks what the
// schemas cannot see across objects.
//
//   node validate.mjs [--dockerfile=FILE] NODE_MODULES WORKDIR NAME=FILE.yaml...
//
// 1. Schema: each object through the kubernetes-models class of its apiVersion/kind (the
//    OpenAPI schema compiled to an ajv validator: types, required fields, enums, formats,
//    patterns, bounds); Gateway API objects through @kubernetes-models/gateway-api, the
//    same way from the Gateway API CRDs' schemas.
// 2. Unknown fields: those validators accept fields the schema does not name (the schemas do
//    not close their objects), so every object is also written out as a TypeScript object
//    literal typed with the package's interface for its kind and compiled with tsc --strict:
//    excess property checking rejects any field the type does not declare, at any depth.
// 3. Across objects: unique names; every namespace used is created by some render; no
//    `replicas` on a Deployment an HPA scales; every ConfigMap a pod reads is rendered; a pod
//    with Secret volumes runs with an fsGroup and group-readable modes (the uid cannot read
//    root-owned 0400 files otherwise); every GRPCRoute attaches to a rendered Gateway and
//    sends to a rendered Service port; every BackendTLSPolicy targets a rendered Service.
// 4. With --dockerfile: every upsquad/<name> image a pod runs is a target of the Dockerfile, and
//    every file a container names under /usr/local/bin or /usr/share/upsquad (command, args,
//    probes, env and ConfigMap values) is one that target installs: an executable it (or the
//    stage it builds on) copies to /usr/local/bin, or services/<service>/<path> of the tree for
//    /usr/share/upsquad/<service>/<path> when the target copies /usr/share/upsquad/<service>.
// A kind with no model is an error, not a skip. Exit 0 when everything holds, 1 otherwise,
// each problem on stderr as "NAME: Kind/namespace/name: problem".
import { createRequire } from "node:module";
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const argv = process.argv.slice(2);
const dockerfile = argv[0]?.startsWith("--dockerfile=") ? argv.shift().slice(13) : null;
const [modulesArg, workdir, ...inputs] = argv;
const modules = path.resolve(modulesArg);
const require = createRequire(path.join(modules, "x.js"));
const yaml = require("js-yaml");

const GROUPS = {
  "v1": "kubernetes-models/v1",
  "apps/v1": "kubernetes-models/apps/v1",
  "batch/v1": "kubernetes-models/batch/v1",
  "autoscaling/v2": "kubernetes-models/autoscaling/v2",
  "policy/v1": "kubernetes-models/policy/v1",
  "networking.k8s.io/v1": "kubernetes-models/networking.k8s.io/v1",
  "rbac.authorization.k8s.io/v1": "kubernetes-models/rbac.authorization.k8s.io/v1",
  "gateway.networking.k8s.io/v1": "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1",
};

const problems = [];
const objects = []; // {render, obj, id}
const id = (o) => `${o.kind}/${o.metadata?.namespace ?? "-"}/${o.metadata?.name ?? "?"}`;
const fail = (render, o, msg) => problems.push(`${render}: ${o ? id(o) : "-"}: ${msg}`);

for (const arg of inputs) {
  const eq = arg.indexOf("=");
  const render = arg.slice(0, eq), file = arg.slice(eq + 1);
  const docs = yaml.loadAll(fs.readFileSync(file, "utf8")).filter((d) => d != null);
  if (docs.length === 0) fail(render, null, "renders no object");
  for (const obj of docs) objects.push({ render, obj });
}

// ---- 1. schema, by the compiled validators ----
// The packages are ES modules exporting "<group>/<version>/<Kind>"; the file behind it.
function modelModule(o) {
  const base = GROUPS[o.apiVersion];
  if (!base || !/^[A-Za-z]+$/.test(o.kind ?? "")) return null;
  const spec = `${base}/${o.kind}`;
  return fs.existsSync(path.join(modules, spec + ".js")) ? spec : null;
}

for (const { render, obj } of objects) {
  const mod = modelModule(obj);
  if (!mod) {
    fail(render, obj, `no schema for ${obj.apiVersion} ${obj.kind}`);
    continue;
  }
  const Cls = (await import(pathToFileURL(path.join(modules, mod + ".js")).href))[obj.kind];
  try {
    new Cls(obj).validate();
  } catch (e) {
    fail(render, obj, "schema: " + String(e.message).split("\n").slice(0, 5).join("; "));
  }
}

// ---- 2. unknown fields, by TypeScript's excess property checks ----
{
  fs.mkdirSync(workdir, { recursive: true });
  const lines = [];
  const lineOf = new Map();
  const typed = objects.filter(({ obj }) => modelModule(obj));
  typed.forEach(({ obj }, i) => {
    const mod = modelModule(obj);
    lines.push(`import type { I${obj.kind} as T${i} } from "${mod}";`);
  });
  typed.forEach((o, i) => {
    lineOf.set(lines.length + 1, o);
    lines.push(`export const o${i}: T${i} = ${JSON.stringify(o.obj)};`);
  });
  const src = path.join(workdir, "objects.mts");
  fs.writeFileSync(src, lines.join("\n") + "\n");
  fs.rmSync(path.join(workdir, "node_modules"), { force: true });
  fs.symlinkSync(path.resolve(modules), path.join(workdir, "node_modules"));
  let out = "";
  try {
    execFileSync(process.execPath, [path.join(modules, "typescript", "bin", "tsc"), "--noEmit",
      "--strict", "--skipLibCheck", "--target", "es2022", "--module", "node16",
      "--moduleResolution", "node16", src], { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
  } catch (e) {
    out = (e.stdout || "") + (e.stderr || "");
    if (!out.trim()) out = "tsc failed: " + e.message;
  }
  for (const line of out.split("\n").filter((l) => l.trim())) {
    const m = /objects\.mts\((\d+),\d+\): error (TS\d+: .*)/.exec(line);
    const o = m && lineOf.get(Number(m[1]));
    if (o) fail(o.render, o.obj, "field: " + m[2]);
    else if (!/^\s/.test(line)) problems.push("tsc: " + line);
  }
}

// ---- 3. across objects ----
const byRender = new Map();
for (const o of objects) {
  if (!byRender.has(o.render)) byRender.set(o.render, []);
  byRender.get(o.render).push(o.obj);
}
const createdNs = new Set(objects.filter(({ obj }) => obj.kind === "Namespace").map(({ obj }) => obj.metadata.name));

function podSpecOf(o) {
  if (["Deployment", "StatefulSet", "DaemonSet", "Job"].includes(o.kind)) return o.spec?.template?.spec;
  if (o.kind === "CronJob") return o.spec?.jobTemplate?.spec?.template?.spec;
  return null;
}

for (const [render, objs] of byRender) {
  const seen = new Set();
  const find = (kind, ns, name) => objs.find((x) => x.kind === kind && x.metadata?.name === name &&
    (x.metadata?.namespace ?? "") === (ns ?? ""));
  for (const o of objs) {
    if (seen.has(id(o))) fail(render, o, "defined twice");
    seen.add(id(o));
    const ns = o.metadata?.namespace;
    if (o.kind !== "Namespace" && !ns) fail(render, o, "no namespace");
    if (ns && !createdNs.has(ns)) fail(render, o, `namespace ${ns} is created by no render`);
  }
  for (const hpa of objs.filter((o) => o.kind === "HorizontalPodAutoscaler")) {
    const ref = hpa.spec.scaleTargetRef;
    const target = find(ref.kind, hpa.metadata.namespace, ref.name);
    if (!target) fail(render, hpa, `scales ${ref.kind} ${ref.name}, which is not rendered`);
    else if (target.spec?.replicas !== undefined) fail(render, target, "sets replicas while an HPA owns them");
  }
  for (const o of objs) {
    const pod = podSpecOf(o);
    if (!pod) continue;
    const ns = o.metadata.namespace;
    const containers = [...(pod.initContainers ?? []), ...(pod.containers ?? [])];
    const cms = new Set();
    for (const c of containers) {
      for (const e of c.envFrom ?? []) if (e.configMapRef) cms.add(e.configMapRef.name);
      for (const e of c.env ?? []) if (e.valueFrom?.configMapKeyRef) cms.add(e.valueFrom.configMapKeyRef.name);
    }
    for (const v of pod.volumes ?? []) if (v.configMap) cms.add(v.configMap.name);
    for (const name of cms) if (!find("ConfigMap", ns, name)) fail(render, o, `reads ConfigMap ${name}, which is not rendered`);
    const secretVols = (pod.volumes ?? []).filter((v) => v.secret);
    if (secretVols.length) {
      const uid = pod.securityContext?.runAsUser;
      if (uid !== undefined && uid !== 0 && pod.securityContext?.fsGroup === undefined)
        fail(render, o, "Secret volumes with a non-root uid and no fsGroup: the files are root's");
      for (const v of secretVols) {
        const mode = v.secret.defaultMode ?? 0o644;
        if (!(mode & 0o040)) fail(render, o, `Secret volume ${v.name}: mode ${mode.toString(8)} is not group-readable`);
      }
    }
  }
  for (const r of objs.filter((o) => o.kind === "GRPCRoute")) {
    const ns = r.metadata.namespace;
    for (const p of r.spec.parentRefs ?? [])
      if (!find(p.kind ?? "Gateway", p.namespace ?? ns, p.name)) fail(render, r, `parent Gateway ${p.name} is not rendered`);
    for (const rule of r.spec.rules ?? [])
      for (const b of rule.backendRefs ?? []) {
        const svc = find("Service", b.namespace ?? ns, b.name);
        if (!svc) fail(render, r, `backend Service ${b.name} is not rendered`);
        else if (!svc.spec.ports.some((p) => p.port === b.port)) fail(render, r, `Service ${b.name} has no port ${b.port}`);
      }
  }
  for (const p of objs.filter((o) => o.kind === "BackendTLSPolicy"))
    for (const t of p.spec.targetRefs ?? [])
      if (!find(t.kind, p.metadata.namespace, t.name)) fail(render, p, `targets ${t.kind} ${t.name}, which is not rendered`);
}

// ---- 4. images against the Dockerfile ----
if (dockerfile) {
  const root = path.dirname(path.resolve(dockerfile));
  const stages = new Map(); // name -> {from, bins: Set, shares: Set}
  let cur = null;
  for (const raw of fs.readFileSync(dockerfile, "utf8").split("\n")) {
    const line = raw.trim();
    let m = /^FROM\s+(\S+)(?:\s+AS\s+(\S+))?/i.exec(line);
    if (m) {
      cur = { from: m[1], bins: new Set(), shares: new Set() };
      if (m[2]) stages.set(m[2], cur);
      continue;
    }
    m = /^COPY\s+(?:--from=\S+\s+)?(\S+)\s+(\S+)$/i.exec(line);
    if (m && cur) {
      if (m[2] === "/usr/local/bin/") cur.bins.add(path.basename(m[1]));
      else if (m[2].startsWith("/usr/share/upsquad/")) cur.shares.add(m[2].replace(/\/$/, ""));
    }
  }
  const installs = (stage, file) => {
    for (let st = stages.get(stage); st; st = stages.get(st.from)) {
      if (file.startsWith("/usr/local/bin/") && st.bins.has(path.basename(file))) return true;
      for (const d of st.shares) {
        if (file === d || file.startsWith(d + "/")) {
          const rel = file.slice("/usr/share/upsquad/".length).split("/");
          return fs.existsSync(path.join(root, "services", rel[0], ...rel.slice(1)));
        }
      }
    }
    return false;
  };
  const PATH_RE = /\/usr\/(?:local\/bin|share\/upsquad)\/[A-Za-z0-9._\/-]+/g;
  for (const [render, objs] of byRender) {
    for (const o of objs) {
      const pod = podSpecOf(o);
      if (!pod) continue;
      for (const c of [...(pod.initContainers ?? []), ...(pod.containers ?? [])]) {
        const m = /^upsquad\/([a-z0-9-]+)(?::|@|$)/.exec(c.image ?? "");
        if (!m) continue;
        if (!stages.has(m[1])) {
          fail(render, o, `image ${c.image}: no target ${m[1]} in ${path.basename(dockerfile)}`);
          continue;
        }
        const values = [c.command, c.args, c.startupProbe, c.readinessProbe, c.livenessProbe,
          (c.env ?? []).map((e) => e.value)];
        for (const e of c.envFrom ?? []) {
          const cm = e.configMapRef && objs.find((x) => x.kind === "ConfigMap" &&
            x.metadata.name === e.configMapRef.name && x.metadata.namespace === o.metadata.namespace);
          if (cm) values.push(Object.values(cm.data ?? {}));
        }
        for (const f of new Set(JSON.stringify(values).match(PATH_RE) ?? []))
          if (!installs(m[1], f)) fail(render, o, `container ${c.name}: ${f} is not in image target ${m[1]}`);
      }
    }
  }
}

for (const p of problems) process.stderr.write(p + "\n");
process.stdout.write(`${objects.length} objects in ${byRender.size} renders: ${problems.length ? problems.length + " problems" : "valid"}\n`);
process.exit(problems.length ? 1 : 0);
