// The console works without this file; it only adds "select this page" to the
// dead-letter list. Served from /static (the page's CSP allows no inline script).
document.addEventListener("DOMContentLoaded", () => {
  const all = document.getElementById("select-all");
  if (!all) return;
  all.addEventListener("change", () => {
    for (const box of document.querySelectorAll("input.pick")) box.checked = all.checked;
  });
});
