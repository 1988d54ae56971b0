// Draws the figures of a run page (built server-side by auditor/web/plots.py and embedded
// as JSON) with plotly.js, and switches the per-rank chart between the bad steps shown.
(function () {
  "use strict";
  var figures = JSON.parse(document.getElementById("page-figures").textContent);
  var config = {responsive: true, displaylogo: false, modeBarButtonsToRemove: ["toImage"]};

  function draw(id, fig) {
    var el = document.getElementById(id);
    if (!el || !fig) { return; }
    Plotly.react(el, fig.data, fig.layout, config);
    var n = 0;
    fig.data.forEach(function (t) { n += (t.x || []).length; });
    el.setAttribute("data-points", String(n));
  }

  function select(key, step) {
    var f = figures[key];
    if (!f || !(step in f.steps)) { return; }
    f.selected = step;
    draw(key + "-ranks", f.steps[step]);
    var el = document.getElementById(key + "-ranks");
    el.setAttribute("data-step", step);
    document.querySelectorAll('.step-detail[data-stat="' + key + '"]').forEach(function (d) {
      d.hidden = d.getAttribute("data-step") !== step;
    });
    document.querySelectorAll('.step-btn[data-stat="' + key + '"]').forEach(function (b) {
      b.classList.toggle("on", b.getAttribute("data-step") === step);
    });
  }

  Object.keys(figures).forEach(function (key) {
    var f = figures[key];
    draw(key + "-sigma", f.sigma);
    draw(key + "-timeline", f.timeline);
    draw(key + "-drift", f.drift);
    if (f.selected !== null) { select(key, f.selected); }
  });
  document.querySelectorAll(".step-btn").forEach(function (b) {
    b.addEventListener("click", function () { select(b.getAttribute("data-stat"), b.getAttribute("data-step")); });
  });
  document.body.setAttribute("data-ready", "1");
})();
