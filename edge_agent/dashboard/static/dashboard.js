// Live refresh without reloading: every few seconds fetch this page's own `?partial=1`
// fragment (rendered and escaped by the server) and swap it in when it changed. Charts are
// drawn by plotly.js (served from the installed plotly package) from JSON the page carries
// in <script type="application/json">; this file only maps that data onto Plotly traces.
"use strict";
(function () {
  var main = document.getElementById("content");
  var live = document.getElementById("live");
  if (!main) return;
  var every = 1000 * (parseInt(main.dataset.refresh, 10) || 3);
  var last = main.innerHTML;

  function draw() {
    if (typeof Plotly === "undefined") return;
    main.querySelectorAll("div.chart").forEach(function (div) {
      var blob = div.dataset.source ? document.getElementById(div.dataset.source)
                                    : main.querySelector("script.chart-data");
      if (!blob) return;
      var data = JSON.parse(blob.textContent);
      // rows (a list of objects) or columns (an object of lists)
      var rows = Array.isArray(data) ? data : null;
      var xs = rows ? rows.map(function (row) { return row[div.dataset.x]; }) : data[div.dataset.x];
      var traces = JSON.parse(div.dataset.series).map(function (s) {
        var ys = rows ? rows.map(function (row) { return row[s[0]]; }) : data[s[0]];
        return {x: xs, y: ys, name: s[1], type: s[2] === "bar" ? "bar" : "scatter",
                mode: "lines+markers", yaxis: s[3]};
      });
      // data-y / data-y2: each axis's own scale (a fraction's 0..1, a ratio from 0), so
      // plotly's autorange neither pads an accuracy past 100 % nor blows noise up to a slope
      Plotly.react(div, traces, {
        title: {text: div.dataset.title || "", font: {size: 14}}, barmode: "group",
        margin: {l: 48, r: 48, t: div.dataset.title ? 36 : 12, b: 64}, height: 280,
        legend: {orientation: "h", y: -0.25}, xaxis: {automargin: true, type: div.dataset.xtype || "category"},
        yaxis: Object.assign({automargin: true}, JSON.parse(div.dataset.y || "{}")),
        yaxis2: Object.assign({overlaying: "y", side: "right", automargin: true}, JSON.parse(div.dataset.y2 || "{}"))
      }, {responsive: true, displaylogo: false, displayModeBar: false});
    });
  }

  function refresh() {
    var url = new URL(window.location.href);
    url.searchParams.set("partial", "1");
    fetch(url, {credentials: "same-origin", cache: "no-store"}).then(function (r) {
      if (!r.ok) throw new Error(r.status);
      return r.text();
    }).then(function (html) {
      if (html !== last) {
        main.innerHTML = html;
        last = main.innerHTML;
        draw();
      }
      live.className = "live ok";
      live.dataset.updated = String(Date.now());
    }).catch(function () {
      live.className = "live stale";
    }).finally(function () {
      window.setTimeout(refresh, every);
    });
  }

  var form = document.getElementById("filters");
  if (form) {
    form.querySelectorAll("select").forEach(function (el) {
      el.addEventListener("change", function () { form.submit(); });
    });
  }
  window.addEventListener("load", draw);
  window.setTimeout(refresh, every);
})();
