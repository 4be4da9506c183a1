// The course site's one script.
document.addEventListener("DOMContentLoaded", () => {
  // A tap (or click) on a figure opens it at full size, so that a phone reader can zoom into
  // a picture the page shows shrunk to the screen's width.
  for (const img of document.querySelectorAll("article .cell_output img")) {
    if (img.closest("a")) continue;
    const link = document.createElement("a");
    link.href = img.getAttribute("src");
    link.className = "kvlab-figure-link";
    link.title = "Open the figure at full size";
    img.replaceWith(link);
    link.appendChild(img);
  }
  // A long identifier in running text may break after each underscore (kvlab.css lets it
  // break anywhere only when even that does not fit).
  for (const pre of document.querySelectorAll("article code.literal span.pre")) {
    const text = pre.textContent;
    if (!text.includes("_") || pre.children.length) continue;
    pre.textContent = "";
    text.split(/(?<=_)/).forEach((part, i) => {
      if (i) pre.appendChild(document.createElement("wbr"));
      pre.appendChild(document.createTextNode(part));
    });
  }
});
