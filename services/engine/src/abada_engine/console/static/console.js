// The console's only script, and none of it is needed to use a page: it checks JSON fields before a
// form is sent, marks edited arguments, and copies an idempotency key when it is clicked.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("textarea[data-json]").forEach((area) => {
    const check = () => {
      let message = "";
      if (area.value.trim() !== "") {
        try { JSON.parse(area.value); } catch (error) { message = "Not JSON: " + error.message; }
      }
      area.setCustomValidity(message);
      area.setAttribute("aria-invalid", message ? "true" : "false");
    };
    area.addEventListener("input", check);
    check();
  });
  document.querySelectorAll("input[data-original]").forEach((input) => {
    const mark = () => input.closest(".field").classList.toggle("edited", input.value !== input.dataset.original);
    input.addEventListener("input", mark);
  });
  // Lists that change on their own (the approvals inbox, the queues) reload every so often, unless
  // the person is typing in a filter.
  const refresh = document.querySelector("[data-refresh]");
  if (refresh) {
    const seconds = Number(refresh.dataset.refresh) || 30;
    setInterval(() => {
      const typing = document.activeElement && ["INPUT", "SELECT", "TEXTAREA"].includes(document.activeElement.tagName);
      if (!typing && document.visibilityState === "visible") window.location.reload();
    }, seconds * 1000);
  }
  document.querySelectorAll("[data-copy]").forEach((code) => {
    code.setAttribute("tabindex", "0");
    code.setAttribute("title", "Click or press Enter to copy");
    const copy = () => {
      if (!navigator.clipboard) return;
      navigator.clipboard.writeText(code.textContent.trim()).then(() => {
        code.classList.add("copied");
        setTimeout(() => code.classList.remove("copied"), 1500);
      }, () => {});
    };
    code.addEventListener("click", copy);
    code.addEventListener("keydown", (event) => { if (event.key === "Enter") copy(); });
  });
});
