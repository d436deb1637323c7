// A run's page: redraw its progress from a small JSON poll while the run is active,
// and ask before the actions that cannot be undone.
"use strict";
{
    const SVG = "http://www.w3.org/2000/svg";
    const number = new Intl.NumberFormat();

    function drawBar(svg, segments) {
        for (const rect of svg.querySelectorAll(".fanout-seg")) {
            rect.remove();
        }
        for (const s of segments) {
            const rect = document.createElementNS(SVG, "rect");
            rect.setAttribute("class", `fanout-seg fanout-seg-${s.status}`);
            rect.setAttribute("x", s.x);
            rect.setAttribute("y", "0");
            rect.setAttribute("width", s.width);
            rect.setAttribute("height", "10");
            const title = document.createElementNS(SVG, "title");
            title.textContent = `${s.status}: ${number.format(s.n)} (${s.percent}%)`;
            rect.append(title);
            svg.append(rect);
        }
    }

    function setText(panel, name, text) {
        for (const el of panel.querySelectorAll(`[data-field="${name}"]`)) {
            el.textContent = text;
        }
    }

    function render(panel, data) {
        const bar = panel.querySelector("[data-fanout-bar]");
        if (bar) {
            drawBar(bar, data.segments);
        }
        for (const [status, n] of Object.entries(data.counts)) {
            for (const el of panel.querySelectorAll(`[data-count="${status}"]`)) {
                el.textContent = number.format(n);
            }
        }
        setText(panel, "percent_done", data.percent_done.toFixed(1));
        setText(panel, "done", number.format(data.done));
        setText(panel, "total", number.format(data.total));
        setText(panel, "cancelled", number.format(data.cancelled));
        for (const el of panel.querySelectorAll('[data-field="cancelled_note"]')) {
            el.hidden = !data.cancelled;
        }
        setText(panel, "rate", data.rate || "–");
        setText(panel, "duration", data.duration || "not started");
        setText(panel, "status_label", data.status_label);
        const waiting = panel.querySelector('[data-field="waiting"]');
        if (waiting) {
            const reasons = Object.entries(data.waiting);
            waiting.hidden = reasons.length === 0;
            waiting.textContent = reasons.length
                ? "Waiting: " + reasons.map(([r, n]) => `${r} (${number.format(n)})`).join("; ")
                : "";
        }
        const why = panel.querySelector('[data-field="why"]');
        if (why) {
            why.hidden = !data.why;
            why.textContent = data.why ? `Why pending items wait: ${data.why}` : "";
            why.classList.toggle("fanout-stalled", data.stalled);
        }
    }

    function poll(panel) {
        const url = panel.dataset.fanoutProgress;
        const interval = parseInt(panel.dataset.interval, 10) || 2000;
        const tick = async () => {
            try {
                const response = await fetch(url, {
                    credentials: "same-origin",
                    headers: {Accept: "application/json"},
                });
                if (response.ok) {
                    const data = await response.json();
                    render(panel, data);
                    if (!data.active) {
                        // Finished: reload once for the join's result and the final state.
                        window.location.reload();
                        return;
                    }
                }
            } catch (error) {
                // A missed poll is retried on the next tick.
            }
            window.setTimeout(tick, interval);
        };
        window.setTimeout(tick, interval);
    }

    function init() {
        for (const form of document.querySelectorAll("form[data-confirm]")) {
            form.addEventListener("submit", (event) => {
                if (!window.confirm(form.dataset.confirm)) {
                    event.preventDefault();
                }
            });
        }
        const panel = document.querySelector("[data-fanout-progress]");
        if (panel && panel.dataset.active === "true") {
            poll(panel);
        }
    }

    if (document.readyState === "loading") {
        document.addEventListener("DOMContentLoaded", init);
    } else {
        init();
    }
}
