# Ring vs parameter-server all-reduce time as hosts are added (bench/netns/cluster_bench.sh
# scaling writes the data). gnuplot -e "datafile='...'; outfile='...'" scaling.gp
set terminal pngcairo size 800,500 font ",11"
set output outfile
set title "All-reduce time per call as hosts are added (fixed payload, shaped links)"
set xlabel "hosts (1 rank each)"
set ylabel "time per all-reduce (ms)"
set key top left
set grid
set xtics (2, 3, 4, 6, 8)
set yrange [0:*]
plot datafile using 1:2 with linespoints lw 2 pt 7 title "ring (gradsync)", \
     datafile using 1:3 with linespoints lw 2 pt 5 title "parameter server (baseline)"
