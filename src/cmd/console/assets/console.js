// The console's one script, served from the binary: it follows running
// jobs on the jobs page. Every page works without it.
"use strict";

function followJobs(table) {
  const source = table.dataset.source;
  const refresh = async () => {
    let jobs;
    try {
      const answer = await fetch(source, { credentials: "same-origin", cache: "no-store" });
      if (!answer.ok) return;
      jobs = await answer.json();
    } catch (e) {
      return;
    }
    let unknown = false;
    for (const job of jobs) {
      const row = table.querySelector(`tr[data-job="${CSS.escape(job.id)}"]`);
      if (!row) { unknown = true; continue; }
      row.dataset.state = job.state;
      row.querySelector(".state").textContent = job.state;
      const bar = row.querySelector("progress");
      bar.max = job.total;
      bar.value = job.done;
      row.querySelector(".done").textContent = `${job.done}/${job.total}`;
      if (job.state !== "running" && job.state !== "interrupted") {
        const cancel = row.querySelector("form.cancel");
        if (cancel) cancel.remove();
      }
    }
    // A job the page does not show yet (one just started): the page is
    // rendered again by the server.
    if (unknown) location.reload();
  };
  setInterval(refresh, 1000);
  refresh();
}

document.addEventListener("DOMContentLoaded", () => {
  const jobs = document.getElementById("jobs");
  if (jobs) followJobs(jobs);
});
