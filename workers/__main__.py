from workers.pool import main

main()
