// Conformance of the C definition validator (build/bin/defn-validate) with the JSON Schema file,
// using ajv (draft 2020-12) as the independent implementation.
//
//   node tests/workflow/conformance.js <defn-validate> <ajv module dir> [--update]
//
// Corpus layout (tests/workflow/corpus/<category>/<case>.json, expectations in <case>.expect.json):
//   valid/       both validators accept; no expectation file
//   structural/  both reject, and the C pointer set == ajv's leaf pointer set == expected pointers
//   semantic/    ajv accepts (the structure is valid); C reports exactly the expected violations
//   limits/      refused before the schema applies (size, depth, UTF-8, JSON syntax, repeated
//                names); C reports exactly the expected violations; ajv is not consulted
// examples/workflows/*.json must be valid. Generated cases (megabyte input, 100000-deep nesting,
// huge arrays, the violation cap) are built in a temporary folder at run time.
// --update rewrites the expectation files from the C output (review the diff before committing).
'use strict';
const fs = require('fs');
const os = require('os');
const path = require('path');
const { execFileSync } = require('child_process');

const [cli, ajvDir, flag] = process.argv.slice(2);
const update = flag === '--update';
const root = path.resolve(__dirname, '..', '..');
const Ajv2020 = require(path.join(path.resolve(ajvDir), 'ajv', 'dist', '2020')).default;
const schema = JSON.parse(fs.readFileSync(path.join(root,
  'services/workflow-engine/schema/workflow-definition.schema.json'), 'utf8'));
const ajv = new Ajv2020({ allErrors: true });
const ajvValidate = ajv.compile(schema);
// Composition keywords report on the node they compose; the C validator reports only leaves.
const COMPOSITE = new Set(['if', 'anyOf', 'oneOf', 'allOf']);

function ajvRun(text) {
  const ok = ajvValidate(JSON.parse(text));
  const pointers = ok ? [] : ajvValidate.errors.filter(e => !COMPOSITE.has(e.keyword))
    .map(e => e.instancePath);
  return { ok, pointers: [...new Set(pointers)].sort() };
}

function cases() {
  const list = [];
  const dir = path.join(__dirname, 'corpus');
  for (const category of ['valid', 'structural', 'semantic', 'limits'])
    for (const f of fs.readdirSync(path.join(dir, category)).sort())
      if (f.endsWith('.json') && !f.endsWith('.expect.json'))
        list.push({ category, name: `${category}/${f.slice(0, -5)}`, file: path.join(dir, category, f) });
  for (const f of fs.readdirSync(path.join(root, 'examples/workflows')).sort())
    if (f.endsWith('.json'))
      list.push({ category: 'valid', name: `examples/${f}`, file: path.join(root, 'examples/workflows', f) });
  return list;
}

// Generated cases: too large to commit, or about the validator's own bounds.
function generated(tmp) {
  const out = [];
  const write = (name, text, check) => {
    const file = path.join(tmp, name + '.json');
    fs.writeFileSync(file, text);
    out.push({ category: 'generated', name: `generated/${name}`, file, check });
  };
  const step = { type: 'agent_action', agent_role: 'eng', prompt: 'x' };
  const big = JSON.stringify({ version: 1, start: 'a', steps: { a: step }, description: 'x'.repeat(1200000) });
  write('megabyte-input', big, v => v.length === 1 && v[0].instance_location === '' &&
    v[0].message === `definition is ${Buffer.byteLength(big)} bytes; the limit is 262144 bytes`);
  const deep = '{"version":1,"start":"a","steps":{"a":' + '['.repeat(100000) + ']'.repeat(100000) + '}}';
  write('nesting-100000', deep, v => v.length === 1 && v[0].instance_location === '' &&
    v[0].message === 'definition nests deeper than 32 levels (byte 68)');
  const options = Array.from({ length: 5000 }, (_, k) => ({ value: `v${k}` }));
  write('huge-options-array', JSON.stringify({ version: 1, start: 'u', steps: { u: { type: 'user_input', question: 'q', options } } }),
    'structural');
  const steps = {};
  for (let k = 0; k < 300; k++) steps[`s${k}`] = step;
  write('too-many-steps', JSON.stringify({ version: 1, start: 's0', steps }), 'structural');
  const bad = {};
  for (let k = 0; k < 250; k++) bad[`s${k}`] = { type: 'loop', body: 's0', max_iterations: 99 };
  write('violation-cap', JSON.stringify({ version: 1, start: 's0', steps: bad }), v =>
    v.length === 200 && v[198].instance_location === '/steps/s198/max_iterations' &&
    v[199].instance_location === '' && v[199].message === '51 more violations not reported (at most 200 are)');
  return out;
}

function main() {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'defn-conformance-'));
  let failures = 0, count = 0;
  try {
    const all = cases().concat(generated(tmp));
    // One C process for the whole corpus (exit status 1 = some definitions invalid).
    let out;
    try {
      out = execFileSync(cli, ['--json', ...all.map(c => c.file)], { cwd: root, maxBuffer: 64 << 20 });
    } catch (e) {
      if (e.status !== 1) throw e;
      out = e.stdout;
    }
    const results = out.toString().trim().split('\n').map(l => JSON.parse(l));
    if (results.length !== all.length) throw new Error(`expected ${all.length} results, got ${results.length}`);
    const fail = (c, why) => { failures++; console.log(`FAIL ${c.name}: ${why}`); };
    all.forEach((c, i) => {
      count++;
      const r = results[i];
      const cPointers = [...new Set(r.violations.map(v => v.instance_location))].sort();
      const expectFile = c.file.replace(/\.json$/, '.expect.json');
      const text = fs.readFileSync(c.file, 'utf8');
      if (c.category === 'valid') {
        if (!r.valid) return fail(c, `C rejects: ${JSON.stringify(r.violations)}`);
        const a = ajvRun(text);
        if (!a.ok) return fail(c, `ajv rejects: ${JSON.stringify(a.pointers)}`);
      } else if (c.category === 'structural' || c.check === 'structural') {
        const a = ajvRun(text);
        if (a.ok || r.valid) return fail(c, `must be invalid for both (C valid=${r.valid}, ajv valid=${a.ok})`);
        if (JSON.stringify(a.pointers) !== JSON.stringify(cPointers))
          return fail(c, `pointer sets differ\n  C:   ${JSON.stringify(cPointers)}\n  ajv: ${JSON.stringify(a.pointers)}`);
        if (c.category === 'structural') {
          if (update) fs.writeFileSync(expectFile, JSON.stringify({ pointers: cPointers }, null, 2) + '\n');
          const want = JSON.parse(fs.readFileSync(expectFile, 'utf8')).pointers;
          if (JSON.stringify(want) !== JSON.stringify(cPointers))
            return fail(c, `pointers ${JSON.stringify(cPointers)} != expected ${JSON.stringify(want)}`);
        }
      } else if (c.category === 'generated') {
        if (!c.check(r.violations)) return fail(c, `unexpected: ${JSON.stringify(r.violations).slice(0, 400)}`);
      } else {
        if (c.category === 'semantic') {
          const a = ajvRun(text);
          if (!a.ok) return fail(c, `semantic case must be structurally valid; ajv: ${JSON.stringify(a.pointers)}`);
        }
        if (update) fs.writeFileSync(expectFile, JSON.stringify({ violations: r.violations }, null, 2) + '\n');
        const want = JSON.parse(fs.readFileSync(expectFile, 'utf8')).violations;
        if (JSON.stringify(want) !== JSON.stringify(r.violations))
          return fail(c, `violations differ\n  got:  ${JSON.stringify(r.violations)}\n  want: ${JSON.stringify(want)}`);
      }
    });
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
  console.log(`conformance: ${count - failures}/${count} cases agree`);
  process.exit(failures ? 1 : 0);
}

main();
