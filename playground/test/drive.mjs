// Drives the playground page in headless Chromium (Playwright's core package, Debian's chromium) and
// checks that the numbers it shows equal a native run of the same replay code for the same requests.
//
// node drive.mjs URL REPLAY_BIN OUT_DIR
//   URL         the served page (scripts/test-playground serves out/playground on 127.0.0.1)
//   REPLAY_BIN  the native `playground-replay` binary
//   OUT_DIR     where the page's requests and both result sets are written (for a failure's autopsy)
//
// The page is never compared with itself: the expected figures come from the native binary, which runs
// kvsteer_playground::replay (the routing core, the simulated engines and the workload code) compiled
// for x86-64, given the exact requests the page built from its form.

import { chromium } from "playwright-core";
import { execFileSync } from "node:child_process";
import { writeFileSync, mkdirSync } from "node:fs";
import { join } from "node:path";

const [url, replayBin, outDir] = process.argv.slice(2);
if (!url || !replayBin || !outDir) {
  console.error("usage: node drive.mjs URL REPLAY_BIN OUT_DIR");
  process.exit(2);
}
mkdirSync(outDir, { recursive: true });

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync"],
});
let failures = 0;
const fail = (msg) => { failures++; console.error("FAIL: " + msg); };

// Same formatting as the page (app.js, `fmt`): the test checks the text a person reads.
const fmt = {
  ms: (v) => v.toFixed(1),
  s: (v) => v.toFixed(2),
  rate: (v) => v.toFixed(0),
  pct: (v) => (100 * v).toFixed(1) + "%",
  cv: (v) => (v === null || v === undefined ? "-" : v.toFixed(3)),
};

async function scenario(page, name, setup, traceFile) {
  console.log(`-- ${name}`);
  await page.goto(url);
  await page.waitForFunction(() => document.body.dataset.state === "ready", null, { timeout: 60000 });
  await setup(page);
  await page.click("#run");
  await page.waitForFunction(() => ["done", "error"].includes(document.body.dataset.state),
    null, { timeout: 300000 });
  const state = await page.evaluate(() => document.body.dataset.state);
  if (state !== "done") {
    fail(`${name}: page says ${await page.textContent("#status")}`);
    return;
  }
  const requests = await page.evaluate(() => window.kvsteerRequests);
  const rows = await page.$$eval("#summary tbody tr", (trs) => trs.map((tr) => {
    const cells = {};
    for (const td of tr.querySelectorAll("td")) cells[td.dataset.key] = { text: td.textContent, value: td.dataset.value };
    return cells;
  }));
  const charts = await page.$$eval("#decode-charts .decode", (ds) => ds.map((d) => ({
    policy: d.dataset.policy, paths: d.querySelectorAll("path").length })));
  const cdfPaths = await page.$$eval("#ttft-cdf path", (ps) => ps.length);
  const reqFile = join(outDir, `${name}.requests.json`);
  writeFileSync(reqFile, JSON.stringify(requests, null, 1));
  const args = [reqFile];
  if (traceFile) args.push(traceFile);
  const native = JSON.parse(execFileSync(replayBin, args, { maxBuffer: 1 << 28 }).toString());
  writeFileSync(join(outDir, `${name}.native.json`), JSON.stringify(native));
  writeFileSync(join(outDir, `${name}.page.json`), JSON.stringify(rows));

  if (rows.length !== native.length) fail(`${name}: ${rows.length} rows shown, ${native.length} expected`);
  console.log("policy           requests  TTFT p50  TTFT p99  e2e p99 s  tok/s   hit     CV     per replica");
  for (const [i, n] of native.entries()) {
    const row = rows[i] || {};
    const expect = {
      policy: n.policy,
      requests: String(n.requests),
      ttft_p50: fmt.ms(n.ttft_ms.p50),
      ttft_p99: fmt.ms(n.ttft_ms.p99),
      tpot_p50: fmt.ms(n.tpot_ms.p50),
      session_e2e_p99: fmt.s(n.session_e2e_s.p99),
      output_tokens_per_s: fmt.rate(n.output_tokens_per_s),
      hit_rate: fmt.pct(n.hit_rate),
      decode_cv: fmt.cv(n.decode_cv),
      requests_per_replica: n.requests_per_replica.join(" / "),
    };
    for (const [k, v] of Object.entries(expect)) {
      const shown = row[k] ? row[k].text : undefined;
      if (shown !== v) fail(`${name}: ${n.policy} ${k}: page shows ${shown}, native run gives ${v}`);
    }
    // Exact values too, where they are integers.
    if (row.requests_per_replica && row.requests_per_replica.value !== n.requests_per_replica.join(","))
      fail(`${name}: ${n.policy} requests per replica differ`);
    if (n.requests === 0) fail(`${name}: ${n.policy} finished no request`);
    const chart = charts.find((c) => c.policy === n.policy);
    const replicas = requests[i].replicas;
    if (!chart || chart.paths !== replicas) fail(`${name}: ${n.policy} decode chart has ${chart && chart.paths} lines, want ${replicas}`);
    console.log(`${n.policy.padEnd(16)} ${String(n.requests).padStart(8)} ${expect.ttft_p50.padStart(9)} ` +
      `${expect.ttft_p99.padStart(9)} ${expect.session_e2e_p99.padStart(10)} ${expect.output_tokens_per_s.padStart(6)} ` +
      `${expect.hit_rate.padStart(6)} ${expect.decode_cv.padStart(6)}  ${expect.requests_per_replica}`);
  }
  if (cdfPaths !== native.length) fail(`${name}: TTFT CDF has ${cdfPaths} lines, want ${native.length}`);
}

async function setNumber(page, id, value) {
  await page.fill(`#${id}`, String(value));
}

async function choosePolicies(page, chosen) {
  for (const p of await page.$$eval("#policies input", (is) => is.map((i) => i.value))) {
    const box = page.locator(`#policies input[value=${p}]`);
    if (chosen.includes(p)) await box.check(); else await box.uncheck();
  }
}

try {
  const page = await browser.newPage();
  const offsite = [];
  page.on("request", (r) => { if (!r.url().startsWith(new URL(url).origin)) offsite.push(r.url()); });
  page.on("pageerror", (e) => fail("page error: " + e));

  await scenario(page, "rl", async (p) => {
    await p.check("input[name=workload][value=rl]");
    await setNumber(p, "rl-steps", 1);
    await setNumber(p, "rl-turns", 3);
    await setNumber(p, "rl-concurrency", 8);
    await setNumber(p, "rl-scale", 8);
    await setNumber(p, "replicas", 3);
    await setNumber(p, "kv-blocks", 4096);
    await setNumber(p, "seed", 3);
    await choosePolicies(p, ["round_robin", "kv_affinity", "kv_load"]);
  });

  await scenario(page, "mooncake", async (p) => {
    await p.check("input[name=workload][value=mooncake]");
    await setNumber(p, "mooncake-requests", 40);
    await setNumber(p, "mooncake-speed", 1);
    await setNumber(p, "replicas", 2);
    await setNumber(p, "kv-blocks", 0);
    await setNumber(p, "k-weight", 8);
    await setNumber(p, "k-temperature", 0);
    await choosePolicies(p, ["least_load", "kv_load"]);
  }, join(process.env.PLAYGROUND_DIR || "out/playground", "data/mooncake_slice.jsonl"));

  if (offsite.length) fail("the page fetched from elsewhere: " + offsite.join(", "));
} finally {
  await browser.close();
}
if (failures) {
  console.error(`${failures} check(s) failed`);
  process.exit(1);
}
console.log("playground: page numbers equal the native replay");
