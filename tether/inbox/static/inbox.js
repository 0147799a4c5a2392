// Live updates without inline script (the CSP allows only this file): every element with
// data-live="URL" is refreshed from that URL, a fragment the server rendered and escaped.
// The decide form is not part of it: it keeps posting the request id and plan hash it showed.
(function () {
  "use strict";
  var interval = parseInt(document.body.getAttribute("data-poll-ms") || "1500", 10);
  function refresh(el) {
    var url = el.getAttribute("data-live");
    var every = parseInt(el.getAttribute("data-live-ms") || String(interval), 10);
    fetch(url, { credentials: "same-origin", headers: { Accept: "text/html" }, cache: "no-store" })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html !== null && html !== el.getAttribute("data-last")) {
          el.setAttribute("data-last", html);
          var doc = new DOMParser().parseFromString(html, "text/html");
          el.replaceChildren.apply(el, Array.prototype.slice.call(doc.body.childNodes));
        }
      })
      .catch(function () {})
      .then(function () { setTimeout(function () { refresh(el); }, every); });
  }
  document.addEventListener("DOMContentLoaded", function () {
    Array.prototype.forEach.call(document.querySelectorAll("[data-live]"), function (el) {
      setTimeout(function () { refresh(el); }, interval);
    });
    // One decision per click: the button is disabled once the form is sent (the server makes
    // the decision id, so a second post would be the same decision anyway).
    Array.prototype.forEach.call(document.querySelectorAll("form.decide-form"), function (form) {
      form.addEventListener("submit", function (ev) {
        var chosen = ev.submitter;
        if (chosen && chosen.name) {
          var keep = document.createElement("input");
          keep.type = "hidden"; keep.name = chosen.name; keep.value = chosen.value;
          form.appendChild(keep);
        }
        Array.prototype.forEach.call(form.querySelectorAll("button"), function (b) { b.disabled = true; });
      });
    });
  });
})();
