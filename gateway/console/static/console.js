// The admin console's own script: the usage charts (Chart.js), copy buttons, and confirmations
// before destructive changes. htmx refreshes the live panel; everything else is plain HTML forms.
(function () {
  "use strict";

  function drawCharts() {
    var source = document.getElementById("usage-data");
    if (!source || typeof window.Chart === "undefined") {
      return;
    }
    var data = JSON.parse(source.textContent);
    Object.keys(data.charts).forEach(function (name) {
      var canvas = document.getElementById("chart-" + name);
      if (!canvas) {
        return;
      }
      var chart = data.charts[name];
      new window.Chart(canvas, {
        type: "bar",
        data: { labels: data.labels, datasets: chart.datasets },
        options: {
          animation: false,
          responsive: true,
          maintainAspectRatio: false,
          interaction: { mode: "index", intersect: false },
          scales: {
            x: { stacked: true, ticks: { autoSkip: true, maxRotation: 0 } },
            y: { stacked: true, beginAtZero: true, title: { display: true, text: chart.title } }
          },
          plugins: { legend: { position: "bottom" } }
        }
      });
    });
  }

  function copyButtons() {
    document.querySelectorAll("button[data-copy]").forEach(function (button) {
      button.addEventListener("click", function () {
        var input = document.getElementById(button.getAttribute("data-copy"));
        var status = document.getElementById("copy-status");
        var said = function (text) { if (status) { status.textContent = text; } };
        input.select();
        if (navigator.clipboard && window.isSecureContext) {
          navigator.clipboard.writeText(input.value).then(
            function () { said("Copied."); },
            function () { said("Could not copy: select the key and copy it by hand."); }
          );
        } else {
          said(document.execCommand("copy") ? "Copied." : "Select the key and copy it by hand.");
        }
      });
    });
  }

  function confirmations() {
    document.querySelectorAll("form[data-confirm]").forEach(function (form) {
      form.addEventListener("submit", function (event) {
        if (!window.confirm(form.getAttribute("data-confirm"))) {
          event.preventDefault();
        }
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    drawCharts();
    copyButtons();
    confirmations();
  });
})();
